"""An FP8 checkpoint loaded without any ``quantization_config`` is refused (reviewer R2 F8).

When ``config.json`` lost its ``quantization_config`` (or ``from_pretrained(fp8_dir,
config=AutoConfig.from_pretrained(base))`` passes the base model's config), transformers
builds plain ``nn.Linear`` layers, reads the fp8 codes into them as plain values and drops
every ``weight_scale`` as UNEXPECTED: the model loads and its outputs are garbage (measured:
logits off by 1.43 relative). This check runs on that load path (``hf_fp8.patches``
``fp8_without_config``): it reads the safetensors headers of a local folder's weight files
(no tensor data) and raises when an fp8 tensor has a ``*weight_scale`` (or
``*weight_scale_inv``) sibling. Checkpoints that carry their own ``quantization_config``
(hf_fp8, compressed-tensors, transformers' FineGrainedFP8 …) are not looked at.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.utils.safetensors_header import tensor_dtypes

FP8_DTYPE_NAMES = ("F8_E4M3", "F8_E5M2")
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")


def has_quantization_config(config: Any) -> bool:
    """The config (or its text sub-config, as transformers reads it) has one."""
    if getattr(config, "quantization_config", None) is not None:
        return True
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else None
    return getattr(text, "quantization_config", None) is not None


def _local_files(root: str, files: Iterable[str]) -> list[str]:
    """The ``.safetensors`` files of ``files`` that lie inside the folder ``root``."""
    real_root = os.path.realpath(root)
    inside = []
    for file in files:
        real = os.path.realpath(file)
        if file.endswith(".safetensors") and real.startswith(real_root + os.sep):
            inside.append(file)
    return inside


def _scaled_fp8_tensor(files: list[str]) -> tuple[str, str, str, str] | None:
    """``(tensor, dtype, its scale, file)`` of the first fp8 tensor with a scale sibling."""
    scales: dict[str, str] = {}  # module prefix -> a scale name in it
    fp8: list[tuple[str, str, str]] = []
    for file in files:
        dtypes = tensor_dtypes(file)
        for name, dtype in (dtypes or {}).items():
            prefix, _, leaf = name.rpartition(".")
            if leaf.endswith(_SCALE_SUFFIXES):
                scales.setdefault(prefix, name)
            elif dtype in FP8_DTYPE_NAMES:
                fp8.append((name, dtype, file))
    for name, dtype, file in sorted(fp8):
        scale = scales.get(name.rpartition(".")[0])
        if scale is not None:
            return name, dtype, scale, file
    return None


def _saved_quant_method(root: str) -> str | None:
    """``quant_method`` of ``root/config.json``'s ``quantization_config`` (``None``: none)."""
    try:
        with open(os.path.join(root, "config.json"), encoding="utf-8") as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return qc.get("quant_method", "?") if isinstance(qc, dict) else None


def check_fp8_has_config(root: str, files: Iterable[str] | None, config: Any) -> None:
    """Raise ``CheckpointTensorError`` when the local folder ``root`` holds fp8 weights with
    scales and ``config`` (the one the model is built from) has no ``quantization_config``.
    Reads safetensors headers only; a Hub id, a state dict or a quantized config is left
    alone."""
    if not files or not root or not os.path.isdir(root) or has_quantization_config(config):
        return
    found = _scaled_fp8_tensor(_local_files(root, files))
    if found is None:
        return
    name, dtype, scale, file = found
    saved = _saved_quant_method(root)
    if saved is not None:
        fix = (
            f"{os.path.join(root, 'config.json')} has a quantization_config "
            f"(quant_method={saved!r}) but the config passed to from_pretrained has none: "
            "do not pass the base model's config (config=...); load this folder's own "
            "(AutoConfig.from_pretrained(folder)), or drop config="
        )
    else:
        fix = (
            f"{os.path.join(root, 'config.json')} has no quantization_config: restore the one "
            "the checkpoint was saved with (an hf_fp8 checkpoint: save it again with "
            "save_pretrained after `import hf_fp8`), and do not pass the base model's config "
            "(config=...)"
        )
    raise CheckpointTensorError(
        f"{name} in {file} is FP8 ({dtype}) with its scale {scale}, but the model is loading "
        "without a quantization_config: transformers would read the fp8 codes as plain values "
        f"and drop every scale (silently wrong outputs). {fix}"
    )
