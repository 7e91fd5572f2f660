"""Quantize / dequantize per tensor, per row and per block (pure functions).

Granularity and the shape of the fp32 ``scale`` for an input ``x`` of shape ``[..., R, C]``
(weights are ``[N, K]``, activations ``[tokens, K]``):

* ``"tensor"``: ``[1]``
* ``"row"`` (weights: per output channel; activations: per token): ``[..., R, 1]``
* ``"block"``: ``[..., ceil(R/bn), ceil(C/bk)]`` for ``block_size=(bn, bk)``; weights use
  ``(128, 128)``, activations ``(1, 128)``.

Non-finite values never enter a scale (one ``inf`` token does not wipe out the others) and
always come out of the cast as NaN, never as zeros or ±max. A finite value always comes out
finite: past ``fp8_max * scale`` it saturates at ±max, also where ``x / scale`` overflows
float32 (``|x| > 3.4e38 * scale``, a static scale far below the activations'). A scale that
is not ``> 0`` (zero, negative, NaN) gives NaN for all of its values (``x / 0`` would
otherwise saturate: all-zero outputs, silently). Weights are checked first:
:func:`quantize_weight` raises on NaN / inf.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_fp8.numerics.formats import fp8_max, min_scale
from hf_fp8.recipe import Granularity, WeightScaleMethod, values

GRANULARITIES = values(Granularity)  # the scale layouts (hf_fp8.recipe.Granularity)


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity={granularity!r} is not supported; use one of {GRANULARITIES}"
        )


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 scale such that ``amax`` maps onto the largest fp8 value, never below
    ``min_scale()`` (so never zero, and tiny tensors keep their resolution)."""
    return (amax.float() / fp8_max(fp8_dtype)).clamp(min=min_scale())


def saturated_cast(
    x: torch.Tensor, fp8_dtype: torch.dtype, source: torch.Tensor | None = None
) -> torch.Tensor:
    """Round to the nearest fp8 value, saturating finite values at ±max.

    NaN and ±inf become NaN (e4m3fn has no inf; a plain cast would turn inf into ±max).
    ``source``: the tensor ``x`` was computed from (``x = source / scale``); then NaN goes
    only where ``source`` is NaN / inf (or ``x`` NaN), and an ``x`` that overflowed to ±inf
    from a finite ``source`` saturates at ±max.
    """
    limit = fp8_max(fp8_dtype)
    finite = torch.isfinite(x if source is None else source)
    return torch.where(finite, x.clamp(-limit, limit), float("nan")).to(fp8_dtype)


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` when ``x`` holds NaN or ±inf."""
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(
            f"cannot quantize {name}: it holds {bad} non-finite value(s) (NaN or inf); "
            "fix the checkpoint or keep this module in high precision "
            "(modules_to_not_convert)"
        )


def _check_block(x: torch.Tensor, block_size: tuple[int, int]) -> tuple[int, int]:
    bn, bk = (int(b) for b in block_size)
    if bn < 1 or bk < 1:
        raise ValueError(f"block_size must be two positive ints, got {tuple(block_size)}")
    if x.dim() < 2:
        raise ValueError(
            f"block granularity needs a tensor [..., rows, cols], got shape {tuple(x.shape)}"
        )
    return bn, bk


def block_scale_shape(shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the block scale of a tensor of ``shape`` ([..., R, C])."""
    *lead, rows, cols = shape
    bn, bk = block_size
    return (*lead, -(-rows // bn), -(-cols // bk))


def _to_blocks(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``[..., R, C]`` → zero-padded ``[..., R/bn, bn, C/bk, bk]``."""
    rows, cols = x.shape[-2:]
    pad_r, pad_c = (-rows) % bn, (-cols) % bk
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))


def _from_blocks(xb: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return xb.flatten(-2).flatten(-3, -2)[..., :rows, :cols]


def _block_scaled(
    x: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int], divide: bool
) -> torch.Tensor:
    """fp32 ``x / scale`` or ``x * scale`` with one scale per block."""
    bn, bk = _check_block(x, block_size)
    expected = block_scale_shape(tuple(x.shape), (bn, bk))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"block scale of shape {tuple(scale.shape)} does not fit a tensor of shape "
            f"{tuple(x.shape)} with block_size {(bn, bk)}; expected {expected}"
        )
    xb = _to_blocks(x.float(), bn, bk)
    s = scale.float().unsqueeze(-1).unsqueeze(-3)
    return _from_blocks(xb / s if divide else xb * s, x.shape[-2], x.shape[-1])


def amax(
    x: torch.Tensor, granularity: str, block_size: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Absolute maximum of the finite values, reduced to the shape of the scale."""
    _check_granularity(granularity)
    if x.numel() == 0:  # e.g. nn.Linear(0, n)'s [n, 0] weight: no value, amax 0 (R24 F3)
        if granularity == "tensor":
            shape: tuple[int, ...] = (1,)
        elif granularity == "row":
            shape = (*x.shape[:-1], 1)
        else:
            shape = block_scale_shape(tuple(x.shape), _check_block(x, block_size))
        return x.new_zeros(shape, dtype=x.dtype if x.dtype.is_floating_point else torch.float32)
    mag = x.abs().nan_to_num(nan=0.0, posinf=0.0)
    if granularity == "tensor":
        return mag.amax().reshape(1)
    if granularity == "row":
        return mag.amax(dim=-1, keepdim=True)
    bn, bk = _check_block(x, block_size)
    return _to_blocks(mag, bn, bk).amax(dim=(-3, -1))


def quantize_with_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str = "tensor",
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """fp8 values of ``x / scale`` (a static or precomputed scale), saturating.

    A scale that is not ``> 0`` (zero, negative, NaN: never a valid scale) gives NaN for
    every value of its group, so a broken static scale shows as NaN, never as zeros."""
    _check_granularity(granularity)
    scale = torch.where(scale > 0, scale.float(), float("nan"))
    if granularity == "block":
        return saturated_cast(_block_scaled(x, scale, block_size, divide=True), fp8_dtype, x)
    return saturated_cast(x.float() / scale.float(), fp8_dtype, x)


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str = "tensor",
    block_size: tuple[int, int] = (128, 128),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to ``(x_fp8, scale)`` with ``x ≈ x_fp8.float() * scale``.

    For activations with ``granularity="block"`` pass ``block_size=(1, bk)``.
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
    """High-precision tensor ``x_fp8.float() * scale``, rounded once to ``dtype``."""
    _check_granularity(granularity)
    if granularity == "block":
        return _block_scaled(x_fp8, scale, block_size, divide=False).to(dtype)
    return (x_fp8.float() * scale.float()).to(dtype)


def _group_sum(x: torch.Tensor, granularity: str, block_size: tuple[int, int]) -> torch.Tensor:
    """Sum of ``x`` reduced to the shape of the scale (as ``amax`` reduces the max)."""
    if granularity == "tensor":
        return x.sum().reshape(1)
    if granularity == "row":
        return x.sum(dim=-1, keepdim=True)
    bn, bk = _check_block(x, block_size)
    return _to_blocks(x, bn, bk).sum(dim=(-3, -1))


SCALE_METHODS = values(WeightScaleMethod)


def mse_scale(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str = "row",
    block_size: tuple[int, int] = (128, 128),
    candidates: int = 41,
    lowest: float = 0.6,
) -> torch.Tensor:
    """Per-group scale minimising the squared quantization error of ``x``.

    Searches clipping points ``f · amax`` for ``f`` in ``[lowest, 1]`` (``f = 1`` is the
    absmax scale, so the error never exceeds absmax's); values past the clip saturate.
    """
    base = amax(x, granularity, block_size)
    x32 = x.float()
    best_scale = amax_to_scale(base, fp8_dtype)
    best_err = None
    for frac in torch.linspace(1.0, lowest, candidates).tolist():
        scale = amax_to_scale(base * frac, fp8_dtype)
        q = quantize_with_scale(x32, scale, fp8_dtype, granularity, block_size)
        err = _group_sum(
            (dequantize(q, scale, torch.float32, granularity, block_size) - x32).square(),
            granularity,
            block_size,
        )
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    return best_scale


def quantize_weight(
    weight: torch.Tensor,
    fp8_dtype: torch.dtype,
    granularity: str = "row",
    block_size: tuple[int, int] = (128, 128),
    name: str = "weight",
    scale_method: str = "absmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[N, K]`` weight; raises ``ValueError`` naming ``name`` on NaN / inf.

    ``scale_method``: ``"absmax"`` (``amax / fp8_max``) or ``"mse"`` (``mse_scale``).
    """
    if weight.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D [out_features, in_features], got {tuple(weight.shape)}"
        )
    check_finite(weight, name)
    if scale_method == "absmax":
        return quantize(weight, fp8_dtype, granularity, block_size)
    if scale_method != "mse":
        raise ValueError(
            f"scale_method={scale_method!r} is not supported; use one of {SCALE_METHODS}"
        )
    scale = mse_scale(weight, fp8_dtype, granularity, block_size)
    return quantize_with_scale(weight, scale, fp8_dtype, granularity, block_size), scale


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (``inf`` when equal)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
