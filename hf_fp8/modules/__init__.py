"""Modules: ``Fp8Linear`` and the one rule for which layers convert (``is_convertible``)."""

from hf_fp8.modules.fp8_linear import (
    ACTIVATION_GRANULARITIES,
    Fp8Linear,
    default_activation_granularity,
    validate_scheme,
)
from hf_fp8.modules.selection import (
    convertible_modules,
    is_conv1d,
    is_convertible,
    is_router,
    keep_reason,
    matches_module,
    unconverted_linears,
    unmatched_patterns,
    warn_unmatched,
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
    "unconverted_linears",
    "unmatched_patterns",
    "validate_scheme",
    "warn_unmatched",
]
