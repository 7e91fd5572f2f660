"""Modules: ``Fp8Linear`` and the one rule for which layers convert (``is_convertible``)."""

from hf_fp8.modules.fp8_linear import Fp8Linear
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
    "Fp8Linear",
    "convertible_modules",
    "is_conv1d",
    "is_convertible",
    "is_router",
    "keep_reason",
    "matches_module",
    "unconverted_linears",
    "unmatched_patterns",
    "warn_unmatched",
]
