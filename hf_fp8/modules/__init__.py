"""Modules: ``Fp8Linear`` and the helpers that swap it in."""

from hf_fp8.modules.fp8_linear import (
    ACTIVATION_GRANULARITIES,
    Fp8Linear,
    default_activation_granularity,
    validate_scheme,
)
from hf_fp8.modules.replace import quantize_model

__all__ = [
    "ACTIVATION_GRANULARITIES",
    "Fp8Linear",
    "default_activation_granularity",
    "quantize_model",
    "validate_scheme",
]
