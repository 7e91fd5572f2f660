"""Quantize / dequantize per tensor, per row and per block (pure functions).

Granularity and the shape of the returned fp32 ``scale`` for an input ``x`` of shape
``[..., K]`` (weights are ``[N, K]``):

* ``"tensor"``: ``[1]``
* ``"row"`` (weights: per output channel; activations: per token): ``[..., 1]``
* ``"block"``: weights ``[ceil(N/bn), ceil(K/bk)]`` for ``block_size=(bn, bk)``;
  activations use ``(1, bk)`` blocks, giving ``[..., ceil(K/bk)]``.
"""

from __future__ import annotations

import torch

from hf_fp8.numerics.formats import AMAX_EPS, fp8_max

GRANULARITIES = ("tensor", "row", "block")


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 scale such that ``amax`` maps onto the largest fp8 value."""
    return amax.float().clamp(min=AMAX_EPS) / fp8_max(fp8_dtype)


def saturated_cast(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round to nearest fp8, saturating finite values at ±max.

    Non-finite inputs stay non-finite: ``x - x`` is 0 for finite x and NaN for ±inf or
    NaN, so an inf activation becomes NaN (e4m3fn has no inf) instead of a silent ±max.
    """
    limit = fp8_max(fp8_dtype)
    return (x.clamp(-limit, limit) + (x - x)).to(fp8_dtype)


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` when ``x`` holds NaN or ±inf."""
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"cannot quantize {name}: it holds {bad} non-finite value(s) (NaN or inf); "
            "fix the checkpoint or keep this module in high precision "
            "(modules_to_not_convert)"
        )


def _blocks(x: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, tuple]:
    """View ``x`` ([..., R, C]; R=1 blocks for activations) as padded blocks."""
    bn, bk = block_size
    *lead, rows, cols = x.shape
    pr, pc = (-rows) % bn, (-cols) % bk
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    nr, nc = (rows + pr) // bn, (cols + pc) // bk
    return x.reshape(*lead, nr, bn, nc, bk), (rows, cols)


def _block_scale_to_full(
    scale: torch.Tensor, block_size: tuple[int, int], rows: int, cols: int
) -> torch.Tensor:
    bn, bk = block_size
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :rows, :cols]


def amax(x: torch.Tensor, granularity: str, block_size: tuple[int, int] = (128, 128)):
    """Absolute maximum reduced to the shape of the scale of ``granularity``."""
    if granularity == "tensor":
        return x.abs().amax().reshape(1)
    if granularity == "row":
        return x.abs().amax(dim=-1, keepdim=True)
    if granularity == "block":
        blocks, _ = _blocks(x, block_size)
        return blocks.abs().amax(dim=(-3, -1))
    raise ValueError(f"granularity={granularity!r} is not supported; use one of {GRANULARITIES}")


def quantize_with_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str = "tensor",
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """fp8 values of ``x / scale`` (a static or precomputed scale)."""
    if granularity == "block":
        full = _block_scale_to_full(scale, block_size, x.shape[-2], x.shape[-1])
        return saturated_cast(x.float() / full, fp8_dtype)
    return saturated_cast(x.float() / scale, fp8_dtype)


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str = "tensor",
    block_size: tuple[int, int] = (128, 128),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to ``(x_fp8, scale)`` with ``x ≈ x_fp8.float() * scale``.

    For activations with ``granularity="block"`` pass ``block_size=(1, bk)`` and a tensor
    whose last two dims are ``[tokens, K]``.
    """
    scale = amax_to_scale(amax(x, granularity, block_size), fp8_dtype)
    return quantize_with_scale(x, scale, fp8_dtype, granularity, block_size), scale


def dequantize(
    x_fp8: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    granularity: str = "tensor",
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """High-precision tensor ``x_fp8.float() * scale`` in ``dtype``."""
    x = x_fp8.float()
    if granularity == "block":
        scale = _block_scale_to_full(scale, block_size, x.shape[-2], x.shape[-1])
    return (x * scale).to(dtype)


def quantize_weight(
    weight: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str = "row",
    block_size: tuple[int, int] = (128, 128),
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[N, K]`` weight; raises ``ValueError`` on non-finite values."""
    if weight.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D [out_features, in_features], got {tuple(weight.shape)}"
        )
    check_finite(weight, name)
    return quantize(weight, fp8_dtype, granularity, block_size)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise.clamp(min=1e-300)))
