"""Checks for FP8 tensors and scales read from disk (pure functions, torch only).

Every tensor a checkpoint hands to hf_fp8 goes through these before use (DESIGN §8). A bad
tensor raises :class:`CheckpointTensorError` naming the tensor, what was found and the fix;
nothing is repaired silently.

Scale bounds. A scale must be float32, finite and > 0. It also has an upper bound,
:func:`max_scale`: ``scale * fp8_max`` is the largest magnitude the tensor dequantizes to, and
it must be representable in the compute dtype (or the dequantized tensor holds inf) and at
most ``MAX_MAGNITUDE = 2**64`` (1.8e19, about the square root of the bfloat16 / float32 range:
past it, the product with a matmul operand of like size is no longer finite). No trained
weight or activation comes near 2**64; a ×1e30 corruption of a 1e-3 scale lands at 4e29.
float16 keeps its own limit (65504): a large fp16 activation is real, not corruption.
There is no lower bound: an all-zero weight row legitimately stores ``AMAX_EPS / fp8_max``.
"""

from __future__ import annotations

import math

import torch

from hf_fp8.numerics.formats import FP8_DTYPES, fp8_max, is_fp8

_FIX = "re-export the checkpoint with hf_fp8 (save_pretrained) or repair this tensor"
_FORMAT_NAMES = {dtype: name for name, dtype in FP8_DTYPES.items()}
# Non-finite fp8 codes: NaN for e4m3fn (low 7 bits all set), inf and NaN for e5m2 (exponent
# bits all set). ``mask`` selects those bits, ``one`` is the lowest of them: a byte is
# non-finite when ``(byte & mask) + one`` carries into bit 7.
_NONFINITE_BITS = {torch.float8_e4m3fn: (0x7F, 0x01), torch.float8_e5m2: (0x7C, 0x04)}


def _count_nonfinite_codes(t: torch.Tensor) -> int:
    """Number of NaN / inf codes of an fp8 tensor, scanning 8 bytes per int64 op."""
    mask, one = _NONFINITE_BITS[t.dtype]
    flat = t.detach().reshape(-1).view(torch.uint8)
    head = flat.numel() // 8 * 8
    if head and flat.is_contiguous() and flat.data_ptr() % 8 == 0:
        # SWAR: no carry crosses a byte (the masked bytes are < 0x80); the top byte's carry
        # wraps the int64, which only sets its sign bit, part of the tested pattern.
        words = flat[:head].view(torch.int64)
        hit = words & int.from_bytes(bytes([mask]) * 8, "little", signed=True)
        hit += int.from_bytes(bytes([one]) * 8, "little", signed=True)
        hit &= int.from_bytes(b"\x80" * 8, "little", signed=True)
        if not bool(hit.any()):
            flat = flat[head:]  # clean words: only the tail needs a byte scan
    return int(((flat & mask) == mask).sum())


class CheckpointTensorError(ValueError):
    """A tensor read from a checkpoint has the wrong dtype, shape or values."""


def _shape(shape) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


MAX_MAGNITUDE = 2.0**64


def max_scale(fp8_dtype: torch.dtype, compute_dtype: torch.dtype) -> float:
    """Largest sane scale: ``scale * fp8_max`` ≤ ``min(finfo(compute_dtype).max, 2**64)``."""
    return min(float(torch.finfo(compute_dtype).max), MAX_MAGNITUDE) / fp8_max(fp8_dtype)


def check_fp8_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...] | torch.Size | None,
    check_values: bool = True,
) -> torch.Tensor:
    """Check an FP8 tensor from disk: exactly ``dtype``, ``shape``, and no NaN / inf codes.

    Returns ``t`` unchanged. ``check_values=False`` skips the pass over the values (one
    byte compare per element); meta tensors are never read.
    """
    if not isinstance(t, torch.Tensor):
        raise CheckpointTensorError(f"{name}: expected a tensor, found {type(t).__name__}")
    if t.dtype != dtype:
        wanted = _FORMAT_NAMES.get(dtype, str(dtype))
        if is_fp8(t.dtype):
            found = _FORMAT_NAMES[t.dtype]
            raise CheckpointTensorError(
                f"{name}: stored as fp8 {found} ({t.dtype}), but the config says "
                f"fp8_format={wanted!r}. The config and the stored bytes disagree: set "
                f"quantization_config.fp8_format={found!r} if the bytes are right, or {_FIX}"
            )
        raise CheckpointTensorError(
            f"{name}: expected fp8 {wanted} ({dtype}), found {t.dtype}. A high-precision "
            "tensor cannot stand in for FP8 codes: quantize high-precision weights with "
            f"Fp8Config, hf_fp8.quantize_model or Fp8Linear.from_linear instead, or {_FIX}"
        )
    if shape is not None and tuple(t.shape) != _shape(shape):
        raise CheckpointTensorError(
            f"{name}: expected shape {_shape(shape)}, found {tuple(t.shape)}; "
            f"the checkpoint does not match this model's config: {_FIX}"
        )
    if check_values and not t.is_meta and t.numel():
        bad = _count_nonfinite_codes(t)
        if bad:
            raise CheckpointTensorError(f"{name}: holds {bad} NaN/inf fp8 code(s); {_FIX}")
    return t


def check_scale_tensor(
    name: str,
    t: torch.Tensor,
    *,
    shape: tuple[int, ...] | torch.Size | None = None,
    max_value: float | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """Check a scale from disk: float32, finite, > 0, ≤ ``max_value``, of ``shape``.

    A 0-d scalar passes where ``shape`` is ``(1,)`` (AutoFP8 / vLLM ``fp8`` store scalars).
    ``max_value`` is usually :func:`max_scale`. Returns ``t`` unchanged; meta tensors (and
    every tensor with ``check_values=False``) are checked for dtype and shape only.
    """
    if not isinstance(t, torch.Tensor):
        raise CheckpointTensorError(f"{name}: expected a tensor, found {type(t).__name__}")
    if t.dtype != torch.float32:
        raise CheckpointTensorError(f"{name}: a scale must be float32, found {t.dtype}; {_FIX}")
    if shape is not None:
        expected = _shape(shape)
        scalar_ok = expected == (1,) and t.dim() == 0
        if tuple(t.shape) != expected and not scalar_ok:
            raise CheckpointTensorError(
                f"{name}: expected scale shape {expected}, found {tuple(t.shape)}; the "
                f"checkpoint's granularity or block size does not match its config: {_FIX}"
            )
    if t.is_meta or not t.numel() or not check_values:
        return t
    # one fused test on the good path (NaN fails every comparison, inf fails the bound);
    # the slower per-condition tests below only run to word the error
    bound = math.inf if max_value is None else max_value
    if bool(((t > 0) & (t <= bound)).all()) and (max_value is not None or bool(t.isfinite().all())):
        return t
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise CheckpointTensorError(
            f"{name}: holds {bad} non-finite value(s) (NaN or inf) out of {t.numel()}; {_FIX}"
        )
    low = float(t.min())
    if low <= 0:
        raise CheckpointTensorError(f"{name}: a scale must be > 0, found min {low:g}; {_FIX}")
    if max_value is not None:
        high = float(t.max())
        if high > max_value:
            raise CheckpointTensorError(
                f"{name}: scale {high:g} exceeds the sane bound {max_value:g}: it dequantizes "
                "to magnitudes past min(the compute dtype's max, 2**64), which overflow in the "
                f"matmul; {_FIX} (with a float16 compute dtype, load with dtype=torch.bfloat16)"
            )
    return t
