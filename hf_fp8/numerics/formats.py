"""FP8 formats and the one scale convention of hf_fp8.

Scale convention (everywhere in hf_fp8, as in ``torch._scaled_mm``, compressed-tensors,
vLLM ``fp8`` and transformers' ``weight_scale_inv``)::

    high_precision ≈ fp8.to(torch.float32) * scale        scale = amax / fp8_max
"""

from __future__ import annotations

import torch

from hf_fp8.recipe import Fp8Format, parse

# Keys are the ``Fp8Format`` words (str enums: ``FP8_DTYPES["e4m3"]`` works too).
FP8_DTYPES: dict[Fp8Format, torch.dtype] = {
    Fp8Format.E4M3: torch.float8_e4m3fn,
    Fp8Format.E5M2: torch.float8_e5m2,
}
_FORMATS = {dtype: fmt for fmt, dtype in FP8_DTYPES.items()}

# An amax at or below this carries no usable information (calibration: a layer that saw only
# zeros). It is NOT a floor of the scales: see ``min_scale``.
AMAX_EPS = 1e-12


def fp8_dtype(fp8_format: str | Fp8Format) -> torch.dtype:
    """Torch dtype of an fp8 format name (``"e4m3"`` or ``"e5m2"``)."""
    return FP8_DTYPES[parse(Fp8Format, fp8_format, "fp8_format")]


def fp8_format_of(dtype: torch.dtype) -> Fp8Format:
    """The format word of an fp8 dtype (the inverse of :func:`fp8_dtype`)."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(
            f"{dtype} is not an fp8 dtype hf_fp8 stores; use one of {list(_FORMATS)}"
        ) from None


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 dtypes hf_fp8 stores (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype in FP8_DTYPES.values()


def min_scale() -> float:
    """Smallest scale hf_fp8 builds: the smallest normal float32 (1.2e-38).

    Tensors with amax down to ``min_scale() * fp8_max`` (5.3e-36 for e4m3) keep their full
    fp8 resolution, so activations of 1e-20 are not flushed to zero; an all-zero tensor gets
    this scale (its fp8 codes are zero, the dequantized tensor exactly zero). A normal, not a
    subnormal number: GPUs that flush subnormals to zero never see a zero scale.
    """
    return float(torch.finfo(torch.float32).tiny)
