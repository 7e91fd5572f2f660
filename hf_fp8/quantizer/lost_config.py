"""FP8 checkpoints that transformers would load as plain weights are refused (R2 F8, R3).

* No quantizer: ``config.json`` lost its ``quantization_config``, ``from_pretrained`` got the
  base model's ``config=`` or ``quantization_config=None``, or the config names a
  ``quant_method`` transformers does not know (it then skips quantization but keeps the
  config). transformers builds plain ``nn.Linear`` layers, reads the fp8 codes into them as
  plain values and drops every ``weight_scale`` as UNEXPECTED: the model loads and its outputs
  are garbage (logits off by 1.43 relative). :func:`check_fp8_has_config` raises when an fp8
  tensor has a ``*weight_scale`` (or ``*weight_scale_inv``) sibling, or lies under a module
  that holds a merged experts scale (``experts.gate_up_proj_weight_scale``: hf_fp8 saves the
  expert codes one per expert, ``experts.0.w1.weight``, and their scales merged, R9 1), or at
  all when the files hold fp8 tensors and merged experts scales (only FP8 quantizers write
  those; GraniteMoE's codes are stored as ``input_linear.weight``).
* transformers' own ``fp8`` quantizer (FineGrainedFP8) on a per-tensor vLLM ``fp8`` export:
  it reads ``weight_scale_inv`` only, so the export's ``weight_scale`` is dropped the same way.
  :func:`check_fp8_scales_for_finegrained` raises when an fp8 tensor has a ``weight_scale``
  sibling and no ``weight_scale_inv`` one.
* A quantizer that quantizes on the fly (``pre_quantized`` false: the checkpoint's config has
  no ``quantization_config`` and ``from_pretrained`` got one, e.g. transformers'
  ``FineGrainedFP8Config(dequantize=True)`` or a ``TorchAoConfig``) reads the checkpoint as
  plain weights the same way (R7 1: 1.43 relative). :func:`check_fp8_has_config` with
  ``quantizing=`` its ``quant_method``.

Both read the dtypes (no tensor data) of exactly the files transformers is about to read — a
local folder's, a Hub cache snapshot's (links into ``blobs/``) and a Hub id's, resolved from
the cache: safetensors headers, and ``torch.save`` files' pickles
(:mod:`hf_fp8.utils.torch_checkpoint_header`, R7 2) — or of the ``state_dict=`` passed. A file
that cannot be read cheaply and safely is skipped (transformers reports it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.utils import torch_checkpoint_header
from hf_fp8.utils.safetensors_header import tensor_dtypes

# safetensors' names; a torch file can also hold the fnuz variants (torch's names)
FP8_DTYPE_NAMES = ("F8_E4M3", "F8_E5M2", "float8_e4m3fnuz", "float8_e5m2fnuz")
STATE_DICT = "the state_dict= passed"  # what messages name as the "file" of a state dict
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
# the scale leaves of merged (fused 3-D) experts parameters: hf_fp8's Fp8Experts
# (``gate_up_proj_weight_scale``), transformers' FP8Experts (``gate_up_proj_scale_inv``)
_MERGED_SCALE_SUFFIXES = ("_weight_scale", "_weight_scale_inv", "_scale_inv")
# scale names transformers' FineGrainedFP8 reads (it renames .scale / .qscale_weight)
_FINEGRAINED_SCALES = ("weight_scale_inv", "qscale_weight", "scale")
_FIX_PER_TENSOR = (
    "convert it to an hf_fp8 checkpoint (`hf-fp8 import SRC DST` or "
    "hf_fp8.import_checkpoint(src, dst), then `import hf_fp8` and load DST), or serve it with vLLM"
)


@dataclass
class _Headers:
    """What the checkpoint's headers (or the state dict passed) hold."""

    fp8: list[tuple[str, str, str]] = field(default_factory=list)  # (tensor, dtype, file)
    scales: dict[str, dict[str, str]] = field(default_factory=dict)  # prefix -> {leaf: name}
    merged: dict[str, list[str]] = field(default_factory=dict)  # experts module -> its scales

    def scale_of(self, name: str) -> str | None:
        """A scale stored for the fp8 tensor ``name``: a sibling (same module), or a merged
        experts scale of a module above it (its codes saved per expert, R9 1)."""
        prefix = name.rpartition(".")[0]
        if prefix in self.scales:
            return next(iter(self.scales[prefix].values()))
        while prefix:
            prefix = prefix.rpartition(".")[0]
            if prefix in self.merged:
                return " / ".join(sorted(self.merged[prefix]))
        return None


def _file_dtypes(file: str) -> dict[str, str] | None:
    """The dtypes stored in one checkpoint file; ``None``: not checkable (see the modules)."""
    if str(file).endswith(".safetensors"):
        return tensor_dtypes(file)
    if str(file).endswith(".gguf"):
        return None  # no fp8 codes with scales in GGUF
    return torch_checkpoint_header.tensor_dtypes(file)  # pytorch_model*.bin


def _sources(files: Iterable[str], state_dict: Any) -> Iterator[tuple[str, dict[str, str]]]:
    """``(file, {tensor: dtype name})`` of each checkpoint file, then of ``state_dict``."""
    for file in files:
        yield str(file), _file_dtypes(str(file)) or {}
    if isinstance(state_dict, Mapping):
        yield (
            STATE_DICT,
            {
                str(name): torch_checkpoint_header.dtype_name(value.dtype)
                for name, value in state_dict.items()
                if isinstance(getattr(value, "dtype", None), torch.dtype)
            },
        )


def _read_headers(files: Iterable[str], state_dict: Any = None) -> _Headers:
    found = _Headers()
    for file, dtypes in _sources(files, state_dict):
        for name, dtype in dtypes.items():
            prefix, _, leaf = name.rpartition(".")
            merged = leaf.endswith(_MERGED_SCALE_SUFFIXES) and leaf not in _SCALE_SUFFIXES
            if merged:
                found.merged.setdefault(prefix, []).append(name)
            if merged or leaf.endswith(_SCALE_SUFFIXES) or leaf in _FINEGRAINED_SCALES:
                found.scales.setdefault(prefix, {}).setdefault(leaf, name)
            elif dtype in FP8_DTYPE_NAMES:
                found.fp8.append((name, dtype, file))
    found.fp8.sort()
    return found


def _quantization_config(config: Any) -> Any:
    """The config's (or its text sub-config's, as transformers reads it) quantization_config."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        return qc
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else None
    return getattr(text, "quantization_config", None)


def _quant_method(qc: Any) -> str:
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method))


def _saved_quant_method(folder: str) -> str | None:
    """``quant_method`` of ``folder/config.json``'s ``quantization_config`` (``None``: none)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return qc.get("quant_method", "?") if isinstance(qc, dict) else None


def _source(name_or_path: str, file: str) -> str:
    """How the message names the checkpoint: the folder, and the Hub id when it was one."""
    folder = os.path.dirname(file)
    if name_or_path and not os.path.isdir(name_or_path):
        return f"{name_or_path!r} ({folder})"
    return folder


def check_fp8_has_config(
    name_or_path: str,
    files: Iterable[str] | None,
    config: Any,
    *,
    quantizing: str | None = None,
    state_dict: Any = None,
) -> None:
    """For a load that transformers runs without a quantizer, or (``quantizing``: its
    ``quant_method``) with one that quantizes on the fly and so reads the checkpoint as plain
    weights: raise ``CheckpointTensorError`` when the checkpoint files (or ``state_dict``) hold
    fp8 weights with scales. ``config`` (the one the model is built from) only shapes the
    message: with no quantizer, a ``quantization_config`` on it is one transformers did not act
    on (an unknown ``quant_method``)."""
    found = _read_headers(files or (), state_dict)
    hit = next(((n, d, f, s) for n, d, f in found.fp8 if (s := found.scale_of(n))), None)
    if hit is None and found.fp8 and found.merged:
        # merged experts scales are written only by FP8 quantizers: their codes may be stored
        # under another module (GraniteMoE saves them as input_linear.weight, R9 1)
        name, dtype, file = found.fp8[0]
        hit = (name, dtype, file, " / ".join(sorted(next(iter(found.merged.values())))))
    if hit is None:
        return
    name, dtype, file, scale = hit
    if quantizing is not None:
        how = (
            f"with quantization_config quant_method={quantizing!r}, which quantizes on the fly "
            "(the config the model is built from has no quantization_config transformers knows "
            "that marks the checkpoint pre-quantized)"
        )
        passed = f"and load without quantization_config= (the {quantizing!r} one)"
    else:
        how = "with no quantizer (no quantization_config that transformers acts on)"
        passed = "and do not pass the base model's config (config=...)"
    if file == STATE_DICT:
        source, fix = (
            "from_pretrained(state_dict=...)",
            "The config passed with it has no quantization_config: pass the FP8 model's own "
            "config (with its quantization_config)"
            + (" and no quantization_config=" if quantizing else "")
            + ", or dequantize the state dict first",
        )
    else:
        source, fix = _source(name_or_path, file), _fix_for_file(file, config, passed, quantizing)
    raise CheckpointTensorError(
        f"{name} in {file} is FP8 ({dtype}) with its scale {scale}, but {source} is loading "
        f"{how}: it would read the fp8 codes as plain values and drop every scale (silently "
        f"wrong outputs). {fix}"
    )


def _fix_for_file(file: str, config: Any, passed: str, quantizing: str | None) -> str:
    """What to do about a checkpoint folder that loads without its quantization_config."""
    config_json = os.path.join(os.path.dirname(file), "config.json")
    qc = _quantization_config(config) if quantizing is None else None
    saved = _saved_quant_method(os.path.dirname(file))
    if qc is not None:
        return (
            f"Its quantization_config names quant_method={_quant_method(qc)!r}, which "
            "transformers does not know, so it skipped quantization: load the checkpoint with "
            "the library that wrote it, or (an FP8 compressed-tensors or vLLM fp8 checkpoint) "
            "convert it with `hf-fp8 import` and load the result with from_pretrained (hf-fp8 "
            "installed: no `import hf_fp8` needed unless HF_FP8_AUTOLOAD=0)"
        )
    if saved is not None and quantizing is not None:
        return (
            f"{config_json} has a quantization_config (quant_method={saved!r}) that this load "
            "does not use (the config= passed has none, or transformers does not know that "
            "quant_method): load with the checkpoint's own config and no quantization_config= "
            "(an unknown quant_method: load it with the library that wrote it, or convert it "
            "with `hf-fp8 import` and load the result with from_pretrained: hf-fp8 installed, no "
            "`import hf_fp8` needed unless HF_FP8_AUTOLOAD=0)"
        )
    if saved is not None:
        return (
            f"{config_json} has a quantization_config (quant_method={saved!r}) but the config "
            "the model is built from has none: do not pass the base model's config (config=...) "
            "or quantization_config=None; load the checkpoint's own "
            "(AutoConfig.from_pretrained(checkpoint)), or drop those arguments"
        )
    return (
        f"{config_json} has no quantization_config: restore the one the checkpoint was "
        "saved with (an hf_fp8 checkpoint: save it again with save_pretrained after "
        f"`import hf_fp8`), {passed}"
    )


def check_fp8_scales_for_finegrained(
    name_or_path: str, files: Iterable[str] | None, model: Any = None
) -> None:
    """For a pre-quantized load by transformers' ``fp8`` quantizer (FineGrainedFP8), which
    reads ``weight_scale_inv`` for its linears: raise ``CheckpointTensorError`` when an fp8
    tensor has a ``weight_scale`` sibling and no ``weight_scale_inv`` (a per-tensor vLLM fp8
    export), unless the module ``model`` built for it reads a ``weight_scale`` itself
    (transformers' ``FP8Embedding`` of ``modules_to_convert``)."""
    found = _read_headers(files or ())
    reads_scale = _modules_with_weight_scale(model)
    for name, dtype, file in found.fp8:
        prefix = name.rpartition(".")[0]
        leaves = found.scales.get(prefix, {})
        if _matches_module(prefix, reads_scale):
            continue
        if "weight_scale" in leaves and not any(s in leaves for s in _FINEGRAINED_SCALES):
            raise CheckpointTensorError(
                f"{leaves['weight_scale']} in {file} is the per-tensor scale of the FP8 "
                f"({dtype}) {name}, but transformers' fp8 quantizer (FineGrainedFP8, "
                "quant_method='fp8') reads only weight_scale_inv (block scales): it would drop "
                f"every weight_scale and load {_source(name_or_path, file)} as garbage. "
                f"This is a per-tensor vLLM fp8 checkpoint: {_FIX_PER_TENSOR}"
            )


def _modules_with_weight_scale(model: Any) -> set[str]:
    """Names of the modules of ``model`` that own a ``weight_scale`` parameter or buffer."""
    if model is None or not hasattr(model, "named_modules"):
        return set()
    return {
        name
        for name, module in model.named_modules()
        if "weight_scale" in module._parameters or "weight_scale" in module._buffers
    }


def _matches_module(prefix: str, names: set[str]) -> bool:
    """Whether checkpoint prefix ``prefix`` is one of ``names``, allowing for the base-model
    prefix (``model.``) that a checkpoint and the built model may differ by."""
    return any(prefix == n or prefix.endswith("." + n) or n.endswith("." + prefix) for n in names)
