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

Weight scales have no lower bound: an all-zero weight row legitimately stores ``min_scale()``
(1.2e-38), and a tiny weight scale only dequantizes to tiny values. Static *input* (activation)
scales have one, :func:`min_input_scale` = ``AMAX_EPS / fp8_max`` (2.2e-15 for e4m3, 1.7e-17
for e5m2): the scale calibration gives an amax of ``AMAX_EPS`` (1e-12), below which an
activation carries no information. A smaller one is a typo or corruption: ``x / scale``
overflows float32 for ``|x| > 3.4e38 * scale`` (every ``|x| > 5e-7`` at ``1e-45``), and at best
saturates every nonzero input. :func:`input_scale_problem` words the refusal for the options
(``Fp8Config``, ``set_input_scale``); :func:`check_scale_tensor` (``min_value=``) for tensors.
"""

from __future__ import annotations

import math

import torch

from hf_fp8.numerics.formats import AMAX_EPS, FP8_DTYPES, fp8_max, is_fp8

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


# below AMAX_EPS / fp8_max by more than float32 rounding: the bound admits every float32
# rounding of that quotient (calibration's, and old checkpoints' 1e-12 / 448)
_ROUNDING_MARGIN = 1 - 2.0**-20


def min_input_scale(fp8_dtype: torch.dtype) -> float:
    """Smallest sane static input scale: ``AMAX_EPS / fp8_max`` (less float32 rounding)."""
    return AMAX_EPS / fp8_max(fp8_dtype) * _ROUNDING_MARGIN


def _below_bound(name: str, value: float, low: float) -> str:
    return (
        f"{name}: {value:g} is below the smallest input scale {low:.3g} (AMAX_EPS / fp8_max, "
        f"the scale of an activation amax of {AMAX_EPS:g}): every activation past "
        f"{value / low * AMAX_EPS:.2g} in magnitude would saturate"
    )


def input_scale_problem(
    name: str, scale: float | torch.Tensor, fp8_dtype: torch.dtype
) -> str | None:
    """Why ``scale`` (a number or tensor of static input scales) is not a usable input scale
    for ``fp8_dtype`` (not finite, not > 0, below :func:`min_input_scale`), or ``None``.
    Callers raise ``ValueError`` with it; meta tensors are not read."""
    low = min_input_scale(fp8_dtype)
    if isinstance(scale, torch.Tensor):
        t = scale.detach()
        if t.is_meta or not t.numel():
            return None
        t = t.float()
        if bool((t >= low).all()) and bool(t.isfinite().all()):
            return None
        shown, smallest = t.reshape(-1)[:8].tolist(), float(t.min())
        bad = not bool(t.isfinite().all()) or smallest <= 0
    else:  # a number (no torch op: this runs under `with torch.device("meta")` too) is
        value = float(scale)  # judged and shown as given, not rounded to float32 first
        if value >= low and math.isfinite(value):
            return None
        shown, smallest, bad = value, value, not math.isfinite(value) or value <= 0
    if bad:
        return f"{name} must be positive finite numbers, got {shown}"
    return (
        _below_bound(name, smallest, low)
        + ". Calibrate it (hf_fp8.calibrate or `hf-fp8 calibrate`), or give the activations' "
        "amax / fp8_max (e.g. 0.05)"
    )


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
    min_value: float | None = None,
) -> torch.Tensor:
    """Check a scale from disk: float32, finite, > 0, ≥ ``min_value``, ≤ ``max_value``, of
    ``shape``.

    A 0-d scalar passes where ``shape`` is ``(1,)`` (AutoFP8 / vLLM ``fp8`` store scalars).
    ``max_value`` is usually :func:`max_scale`; ``min_value`` :func:`min_input_scale` for
    static input scales (``None`` for weight scales). Returns ``t`` unchanged; meta tensors
    (and every tensor with ``check_values=False``) are checked for dtype and shape only.
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
    ok = (t > 0) & (t <= bound) if min_value is None else (t >= min_value) & (t <= bound)
    if bool(ok.all()) and (max_value is not None or bool(t.isfinite().all())):
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
    if min_value is not None and low < min_value:
        raise CheckpointTensorError(
            f"{_below_bound(name, low, min_value)}; re-calibrate the model (hf_fp8.calibrate) "
            f"and save it again, or {_FIX}"
        )
    if max_value is not None:
        high = float(t.max())
        if high > max_value:
            raise CheckpointTensorError(
                f"{name}: scale {high:g} exceeds the sane bound {max_value:g}: it dequantizes "
                "to magnitudes past min(the compute dtype's max, 2**64), which overflow in the "
                f"matmul; {_FIX} (with a float16 compute dtype, load with dtype=torch.bfloat16)"
            )
    return t
