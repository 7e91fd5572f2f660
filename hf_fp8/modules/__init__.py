"""Modules: ``Fp8Linear`` and the helpers that swap it in."""

from hf_fp8.modules.fp8_linear import (
    ACTIVATION_GRANULARITIES,
    Fp8Linear,
    default_activation_granularity,
    validate_scheme,
)
from hf_fp8.modules.replace import quantize_model
from hf_fp8.modules.selection import (
    convertible_modules,
    is_conv1d,
    is_convertible,
    is_router,
    keep_reason,
    matches_module,
    unmatched_patterns,
)

__all__ = [
    "ACTIVATION_GRANULARITIES",
    "Fp8Linear",
    "convertible_modules",
    "default_activation_granularity",
    "is_conv1d",
    "is_convertible",
    "is_router",
    "keep_reason",
    "matches_module",
    "quantize_model",
    "unmatched_patterns",
    "validate_scheme",
]
