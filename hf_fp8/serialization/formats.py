"""The on-disk formats hf_fp8 writes and reads, by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hf_fp8.config import QUANT_METHOD as HF_FP8_METHOD
from hf_fp8.config import Fp8Config
from hf_fp8.serialization import compressed_tensors, vllm_fp8
from hf_fp8.serialization.layers import LayerPlan
from hf_fp8.serialization.names import COMPRESSED_TENSORS, EXPORT_FORMATS, FORMAT_ALIASES, VLLM_FP8

TensorConvert = Callable[[dict[str, torch.Tensor], LayerPlan, Fp8Config], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Format:
    """One foreign format: its ``quant_method`` and the four conversions."""

    name: str
    quant_method: str
    export_config: Callable[[Fp8Config, LayerPlan], dict[str, Any]]
    export_tensors: TensorConvert
    import_kwargs: Callable[[dict[str, Any]], dict[str, Any]]
    import_tensors: Callable[..., dict[str, torch.Tensor]]  # TensorConvert + compute_dtype=
    import_renames: dict[str, str]  # tensor leaf names → hf_fp8's


def _format(name: str, module: ModuleType) -> Format:
    return Format(
        name,
        module.QUANT_METHOD,
        module.export_config,
        module.export_tensors,
        module.import_kwargs,
        module.import_tensors,
        module.IMPORT_RENAMES,
    )


FORMATS: dict[str, Format] = {
    COMPRESSED_TENSORS: _format(COMPRESSED_TENSORS, compressed_tensors),
    VLLM_FP8: _format(VLLM_FP8, vllm_fp8),
}
if tuple(FORMATS) != EXPORT_FORMATS:  # one list of names: names.py
    raise RuntimeError("serialization.names.EXPORT_FORMATS and formats.FORMATS disagree")


def get_format(name: str) -> Format:
    """The format called ``name`` (``"compressed-tensors"`` or ``"vllm-fp8"``)."""
    key = FORMAT_ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"format={name!r} is not supported; use one of {EXPORT_FORMATS}")
    return FORMATS[key]


def format_of(quantization_config: dict[str, Any] | None) -> str:
    """Name of the format a checkpoint's ``quantization_config`` describes:
    ``"hf_fp8"``, ``"compressed-tensors"``, ``"vllm-fp8"``, ``"unquantized"`` or the
    foreign ``quant_method``."""
    if quantization_config is not None and not isinstance(quantization_config, dict):
        kind = type(quantization_config).__name__
        kind = {"str": "a string", "list": "a list"}.get(kind, kind)
        raise ValueError(
            f"config.json's quantization_config is {kind}: expected an object ({{...}}) with a "
            "quant_method; the config is damaged: fix it or re-export the checkpoint"
        )
    if not quantization_config:
        return "unquantized"
    method = quantization_config.get("quant_method")
    if method == HF_FP8_METHOD:
        return "hf_fp8"
    for fmt in FORMATS.values():
        if method == fmt.quant_method:
            return fmt.name
    return str(method)
