"""Numerics: fp8 formats, scales, quantize / dequantize. Pure torch functions."""

from hf_fp8.numerics.formats import (
    AMAX_EPS,
    FP8_DTYPES,
    fp8_dtype,
    fp8_format_of,
    fp8_max,
    is_fp8,
    min_scale,
)
from hf_fp8.numerics.quantize import (
    GRANULARITIES,
    SCALE_METHODS,
    amax,
    amax_to_scale,
    block_scale_shape,
    check_finite,
    dequantize,
    mse_scale,
    quantize,
    quantize_weight,
    quantize_with_scale,
    saturated_cast,
    sqnr_db,
)

__all__ = [
    "AMAX_EPS",
    "FP8_DTYPES",
    "GRANULARITIES",
    "SCALE_METHODS",
    "amax",
    "amax_to_scale",
    "block_scale_shape",
    "check_finite",
    "dequantize",
    "fp8_dtype",
    "fp8_format_of",
    "fp8_max",
    "is_fp8",
    "min_scale",
    "mse_scale",
    "quantize",
    "quantize_weight",
    "quantize_with_scale",
    "saturated_cast",
    "sqnr_db",
]
