"""Modules: ``Fp8Linear``, ``Fp8Experts`` (and ``Fp8BmmExperts`` / ``Fp8ParallelExperts`` for
Llama-4 / JetMoE experts outside transformers' interface) and the one rule for which layers
convert (``is_convertible`` for linears, ``convertible_experts`` for MoE experts);
``high_precision_parts`` says what stays high precision and why."""

from hf_fp8.modules.activation_scales import check_activation_scales, scale_keys
from hf_fp8.modules.fp8_bmm_experts import Fp8BmmExperts
from hf_fp8.modules.fp8_experts import (
    Fp8Experts,
    convertible_experts,
    experts_keep_reason,
    is_experts_module,
    unconverted_experts,
    unsupported_reason,
)
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts
from hf_fp8.modules.frozen import freeze_fp8
from hf_fp8.modules.selection import (
    convertible_modules,
    high_precision_parts,
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
    "Fp8BmmExperts",
    "Fp8Experts",
    "Fp8Linear",
    "Fp8ParallelExperts",
    "check_activation_scales",
    "convertible_experts",
    "convertible_modules",
    "experts_keep_reason",
    "freeze_fp8",
    "high_precision_parts",
    "is_conv1d",
    "is_convertible",
    "is_experts_module",
    "is_router",
    "keep_reason",
    "matches_module",
    "scale_keys",
    "unconverted_experts",
    "unconverted_linears",
    "unmatched_patterns",
    "unsupported_reason",
    "warn_unmatched",
]
