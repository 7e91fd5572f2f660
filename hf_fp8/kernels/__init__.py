"""Kernels: one FP8 linear entry point, ``torch._scaled_mm`` on FP8 GPUs, emulation elsewhere."""

from hf_fp8.kernels.capability import KERNELS, check_kernel, has_fp8_gemm
from hf_fp8.kernels.compiled import compile_enabled
from hf_fp8.kernels.emulated import decode_weight, emulated_linear
from hf_fp8.kernels.fp8_linear import (
    LinearPlan,
    fp8_linear,
    quantize_activation,
)
from hf_fp8.kernels.scaled_mm import scaled_mm_linear, unsupported_reason

__all__ = [
    "KERNELS",
    "LinearPlan",
    "check_kernel",
    "compile_enabled",
    "decode_weight",
    "emulated_linear",
    "fp8_linear",
    "has_fp8_gemm",
    "quantize_activation",
    "scaled_mm_linear",
    "unsupported_reason",
]
