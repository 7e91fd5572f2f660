"""Register ``Fp8Config`` / ``Fp8HfQuantizer`` with transformers under ``"hf_fp8"`` (idempotent)."""

from __future__ import annotations

from transformers.quantizers import auto

from hf_fp8.config import QUANT_METHOD, Fp8Config
from hf_fp8.quantizer.hf_quantizer import Fp8HfQuantizer


def register_with_transformers() -> None:
    """Make ``quant_method="hf_fp8"`` loadable by ``from_pretrained``; safe to call twice."""
    if auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not Fp8Config:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        auto.register_quantization_config(QUANT_METHOD)(Fp8Config)
    if auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not Fp8HfQuantizer:
        auto.AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        auto.register_quantizer(QUANT_METHOD)(Fp8HfQuantizer)
    # Lets from_pretrained(fp8_dir, quantization_config=Fp8Config(dequantize=True / kernel=...))
    # override the saved config's loading attributes, as transformers does for its own FP8.
    loading_types = getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if isinstance(loading_types, tuple) and Fp8Config not in loading_types:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*loading_types, Fp8Config)
