"""Validation (and conversion) of a loaded :class:`~hf_fp8.optim.AdamWFp8` state, per parameter.

A loaded state is untrusted input that the C kernel would address with raw pointers. Before it
is installed, every tensor is checked against the parameter it belongs to: the layout follows
from the parameter's shape and the group's ``group_size`` (see :mod:`hf_fp8.optim._layout`),
codes are fp8 of the configured format, scales and exponents are fp32, finite and in range,
and the padding codes past a row's last column are zero (as the optimizer writes them).
Values are checked too, with limits that follow from the formats: every code is finite (no
NaN / inf bit pattern), second-moment codes are not negative, fp32 moments are finite (but
for a +inf ``exp_avg_sq``: a gradient whose square overflowed, as torch writes it), and
no scale lets the group's largest code decode to inf (``F · scale`` for fp8 codes,
``127 · scale · 2^e`` for the log format's first moment): every moment a state that passes
decodes to is finite. (Finite but inconsistent moments, a huge ``m`` over a tiny ``v``, still
give huge updates, as they do in ``torch.optim.AdamW``.)
An fp32 AdamW state (``exp_avg`` / ``exp_avg_sq``, e.g. from ``torch.optim.AdamW``) is
checked the same way and converted to FP8 moments when this optimizer would quantize the
parameter (under FSDP2 each rank converts its rows: the rows one process converts). Errors name the parameter and the tensor, and say how to fix it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from hf_fp8.numerics import coat, log_moments
from hf_fp8.numerics.formats import fp8_dtype
from hf_fp8.optim._layout import (
    QUANT_KEYS,
    is_dtensor,
    local,
    new_quantized_state,
    quantizable_placements,
    resolved_format,
)

FP32_KEYS = ("exp_avg", "exp_avg_sq")
# Resuming without the optimizer state: the fix every refused state ends with (R37 finding 5).
RESTART_FIX = (
    "resume without the optimizer state to restart the moments: with transformers' Trainer, "
    "move optimizer.pt out of the checkpoint folder (the Trainer then loads neither "
    "optimizer.pt nor scheduler.pt, so the learning-rate schedule restarts too; under FSDP the "
    "optimizer files are optimizer.bin or optimizer_*/)"
)
FIX = (
    "Load a state saved by an optimizer over the same model, or drop this parameter's entry "
    f"from state_dict['state'] to restart its moments, or {RESTART_FIX}"
)
# The saved param group names the format; codes of another format are no state it wrote.
DISAGREE = (
    "the state and its param group do not belong together (a damaged or hand-edited state; "
    "a state loaded with another group's format options)"
)


class OptimizerStateError(ValueError):
    """A loaded optimizer state does not fit its parameter."""


def layout(p: torch.Tensor, group_size: int) -> tuple[int, int, int]:
    """``(rows, cols, groups_per_row)`` of a parameter's quantized state."""
    rows = p.shape[0] if p.dim() else 1
    cols = math.prod(p.shape[1:]) if p.dim() else 1
    return rows, cols, -(-cols // group_size)


def wants_quantized(p: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether a fresh state of ``p`` is quantized (see :class:`AdamWFp8`)."""
    if p.dim() < 2 or p.numel() == 0 or p.numel() < group["min_quantize_numel"]:
        return False
    size = group["group_size"]
    _, cols, gc = layout(p, size)
    # Groups live inside rows: short rows (LoRA B is [out, r]) are mostly padding. Quantize
    # only when the padded state (1 byte + fp32 scale and exponent per group, two moments)
    # is smaller than fp32 AdamW's 8 bytes per element.
    return 2 * gc * (size + 8) < 8 * cols


def _fail(pid: Any, key: str | None, message: str) -> OptimizerStateError:
    where = f"parameter {pid}" + (f", state[{key!r}]" if key else "")
    return OptimizerStateError(f"optimizer state of {where}: {message}. {FIX}.")


def _step(value: Any, pid: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _fail(pid, "step", f"has {value.numel()} elements, expected a scalar")
        value = float(value.detach().reshape(()).float().cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(pid, "step", f"is a {type(value).__name__}, expected a number")
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise _fail(pid, "step", f"is {value}, expected a whole number >= 0")
    return torch.tensor(float(value), dtype=torch.float32)


def _check(
    t: Any, pid: Any, key: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    if not isinstance(t, torch.Tensor):
        raise _fail(pid, key, f"is a {type(t).__name__}, expected a tensor")
    if tuple(t.shape) != tuple(shape):
        raise _fail(pid, key, f"has shape {tuple(t.shape)}, the parameter needs {tuple(shape)}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise _fail(pid, key, f"has dtype {t.dtype}, expected {names}")


def _check_range(t: torch.Tensor, pid: Any, key: str, lo: float, hi: float) -> None:
    v = local(t)
    if v.numel() and not (torch.isfinite(v).all() and (v >= lo).all() and (v <= hi).all()):
        raise _fail(pid, key, f"holds values outside [{lo}, {hi:.7g}] or non-finite values")
    if lo == 0.0 and v.numel() and bool(torch.signbit(v).any()):
        # -0.0 passes ``>= 0``, but the decoders read the scale's bits (0x80000000 wraps)
        raise _fail(pid, key, "holds -0.0 (the sign bit set; scales are never negative)")


def _check_zero_groups(
    codes: torch.Tensor, scale: torch.Tensor, floor: float, pid: Any, key: str
) -> None:
    """Quantization writes zero codes for a group whose ``amax`` is below ``floor`` (the
    format's zero threshold, ``amax = scale · F``): such a group with non-zero codes is not a
    state the optimizer writes, and would decode as if its scale were another (R4 finding 6).
    ``floor`` is halved: a legit subnormal ``scale = amax / F`` rounds by far less."""
    s = local(scale)
    small = s < floor / 2
    if not bool(small.any()):
        return
    c = local(codes)
    b = c.view(torch.uint8).reshape(*s.shape, -1)
    if c.is_floating_point():  # fp8: -0 (0x80) is a zero code too
        b = b & (SIGN_BIT - 1)
    if bool((b != 0)[small].any()):
        raise _fail(
            pid,
            key,
            f"is below {floor / 2:.3g} (a group quantized to zero codes) in a group whose "
            "codes are not zero (a corrupt or hand-edited state)",
        )


FLT_MAX = torch.finfo(torch.float32).max
SIGN_BIT = 0x80


@functools.cache
def first_non_finite_magnitude(fp8: torch.dtype) -> int:
    """The smallest 7-bit magnitude code of ``fp8`` that torch reads as NaN / inf (e4m3fn:
    0x7F, e5m2: 0x7C); every larger one is non-finite too."""
    values = torch.arange(SIGN_BIT, dtype=torch.uint8).view(fp8).float()
    bad = ~torch.isfinite(values)
    first = int(bad.nonzero()[0])
    assert bool(bad[first:].all())
    return first


def _check_codes(t: torch.Tensor, pid: Any, key: str, *, second_moment: bool) -> None:
    """fp8 codes: no NaN / inf bit pattern; second-moment codes not negative (``v >= 0``;
    -0, code 0x80, is zero). On the raw bytes: no fp32 copy of the codes."""
    b = local(t).view(torch.uint8)
    if not b.numel():
        return
    if int((b & (SIGN_BIT - 1)).max()) >= first_non_finite_magnitude(t.dtype):
        raise _fail(pid, key, "holds NaN or inf codes (a corrupt or hand-edited state)")
    if second_moment and int(b.max()) > SIGN_BIT:
        raise _fail(pid, key, "holds negative second-moment codes (v >= 0 always)")


def _check_padding(t: torch.Tensor, cols: int, pid: Any, key: str) -> None:
    """The codes past column ``cols`` (the padding of a row's last group) are zero in every
    state the optimizer writes (fp8 -0, 0x80, is a zero code too). Non-zero padding would
    enter the group's statistics in the reference step but not in the C kernel, which skips
    it: the implementations would diverge silently (R24 finding 5)."""
    c = local(t)
    if c.shape[-1] <= cols:
        return
    b = c.view(torch.uint8)[:, cols:]
    if c.is_floating_point():
        b = b & (SIGN_BIT - 1)
    if bool((b != 0).any()):
        raise _fail(
            pid,
            key,
            f"holds non-zero codes in the padding of the last group (columns {cols} and "
            "later of each row; the optimizer writes zeros there: a corrupt or hand-edited "
            "state)",
        )


def _check_top_decodes(top: torch.Tensor, pid: Any, key: str, what: str) -> None:
    """``top``: each group's largest decodable value; it must be finite in fp32."""
    if top.numel() and not bool(torch.isfinite(top).all()):
        raise _fail(
            pid,
            key,
            f"is so large that {what} decodes to inf in fp32 (a corrupt or hand-edited state)",
        )


# moment_format="log": exactly these entries, dtypes and value ranges (m codes are -127..127;
# a larger m scale would decode the largest code to inf before its power of two).
LOG_LAYOUT = {
    "exp_avg_fp8": (torch.int8, (-log_moments.M_CODE_MAX, log_moments.M_CODE_MAX)),
    "exp_avg_scale": (torch.float32, (0.0, FLT_MAX / log_moments.M_CODE_MAX)),
    "exp_avg_sq_fp8": (torch.uint8, None),
    "exp_avg_sq_scale": (torch.float32, (0.0, FLT_MAX)),
    "exp_avg_sq_exponent": (torch.float32, (coat.EXPONENT_MIN, coat.EXPONENT_MAX)),
}


def _check_log(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], pid: Any) -> None:
    extra = set(state) - set(LOG_LAYOUT) - {"step"}
    if "exp_avg_exponent" in extra or any(
        isinstance(state.get(k), torch.Tensor) and state[k].is_floating_point()
        for k in ("exp_avg_fp8", "exp_avg_sq_fp8")
    ):
        raise _fail(
            pid,
            None,
            "it holds fp8 moment codes (the layout of moment_format='fp8'), but its param group "
            f"says moment_format={group['moment_format']!r} (int8 / uint8 codes): {DISAGREE}",
        )
    if extra:
        raise _fail(pid, None, f"unexpected entries {sorted(extra)} beside the moment codes")
    if p.dim() == 0:
        raise _fail(pid, None, "a 0-d parameter cannot have quantized moments")
    rows, cols, gc = layout(p, group["group_size"])
    gs = group["group_size"]
    for key, (dtype, bounds) in LOG_LAYOUT.items():
        if key not in state:
            raise _fail(pid, key, "is missing")
        shape = (rows, gc * gs) if key.endswith("_fp8") else (rows, gc)
        _check(state[key], pid, key, shape, (dtype,))
        if bounds is not None:
            _check_range(state[key], pid, key, *bounds)
        if key.endswith("_fp8"):
            _check_padding(state[key], cols, pid, key)
    # below these amax (scale·127 for m', scale itself for v) quantization writes zero codes
    _check_zero_groups(
        state["exp_avg_fp8"],
        state["exp_avg_scale"],
        log_moments.M_MIN / log_moments.M_CODE_MAX,
        pid,
        "exp_avg_scale",
    )
    _check_zero_groups(
        state["exp_avg_sq_fp8"], state["exp_avg_sq_scale"], coat.FLT_MIN, pid, "exp_avg_sq_scale"
    )
    # m̂ = (q·scale)·2^e, 2^e <= that of v's largest code (255): the group's largest |m̂|.
    v_scale, v_exp = local(state["exp_avg_sq_scale"]), local(state["exp_avg_sq_exponent"])
    top_v = torch.full((*v_scale.shape, 1), log_moments.V_CODE_MAX, dtype=torch.uint8)
    s_top, _ = log_moments.m_scales(top_v.to(v_scale.device), v_scale, v_exp)
    top_m = torch.full_like(s_top, log_moments.M_CODE_MAX).to(torch.int8)
    top = log_moments.dequantize_m(top_m, local(state["exp_avg_scale"]), s_top)
    _check_top_decodes(top, pid, "exp_avg_scale", "code 127 times the 2^e of exp_avg_sq")


def _check_quantized(
    state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], pid: Any
) -> None:
    if resolved_format(group) == "log":
        _check_log(state, p, group, pid)
        return
    want = fp8_dtype(group["fp8_format"])
    group_says = (
        f"its param group says moment_format={group['moment_format']!r}, "
        f"fp8_format={group['fp8_format']!r}, "
        f"dynamic_range_expansion={group['dynamic_range_expansion']!r}"
    )
    codes, sq_codes = state.get("exp_avg_fp8"), state.get("exp_avg_sq_fp8")
    if all(isinstance(t, torch.Tensor) for t in (codes, sq_codes)) and (
        (codes.dtype, sq_codes.dtype, "exp_avg_exponent" in state)
        == (torch.int8, torch.uint8, False)
    ):  # the whole layout of moment_format='log'
        raise _fail(
            pid,
            None,
            "it holds the integer codes of moment_format='log' (int8 exp_avg_fp8, uint8 "
            f"exp_avg_sq_fp8), but {group_says} ({want} codes): {DISAGREE}",
        )
    expand = bool(group["dynamic_range_expansion"])
    has_exp = "exp_avg_exponent" in state or "exp_avg_sq_exponent" in state
    if has_exp != expand:
        raise _fail(
            pid,
            None,
            f"it {'has' if has_exp else 'lacks'} the exponents of dynamic_range_expansion="
            f"True, but {group_says}: {DISAGREE}",
        )
    extra = set(state) - set(QUANT_KEYS) - {"step"}
    if extra:
        raise _fail(pid, None, f"unexpected entries {sorted(extra)} beside FP8 moments")
    if p.dim() == 0:
        raise _fail(pid, None, "a 0-d parameter cannot have FP8 moments")
    rows, cols, gc = layout(p, group["group_size"])
    gs = group["group_size"]
    for key in QUANT_KEYS:
        if "exponent" in key and not expand:
            continue
        if key not in state:
            raise _fail(pid, key, "is missing")
        t = state[key]
        if key.endswith("_fp8"):
            fp8s = (torch.float8_e4m3fn, torch.float8_e5m2)
            if isinstance(t, torch.Tensor) and t.dtype in fp8s and t.dtype != want:
                raise _fail(
                    pid,
                    key,
                    f"holds {t.dtype} moments, the optimizer expects "
                    f"fp8_format={group['fp8_format']!r} ({want})",
                )
            if isinstance(t, torch.Tensor) and t.dtype != want and t.dtype not in fp8s:
                raise _fail(
                    pid,
                    key,
                    f"has dtype {t.dtype}, but {group_says} ({want} codes): {DISAGREE}",
                )
            _check(t, pid, key, (rows, gc * gs), (want,))
            _check_codes(t, pid, key, second_moment=key == "exp_avg_sq_fp8")
            _check_padding(t, cols, pid, key)
        elif key.endswith("_scale"):
            _check(t, pid, key, (rows, gc), (torch.float32,))
            _check_range(t, pid, key, 0.0, FLT_MAX / torch.finfo(want).max)
        else:
            _check(t, pid, key, (rows, gc), (torch.float32,))
            _check_range(t, pid, key, coat.EXPONENT_MIN, coat.EXPONENT_MAX)
    for name in ("exp_avg", "exp_avg_sq"):  # the largest code F of each group, decoded
        floor = coat.FLT_MIN / torch.finfo(want).max  # amax = F·scale below FLT_MIN: zeros
        _check_zero_groups(
            state[f"{name}_fp8"], state[f"{name}_scale"], floor, pid, f"{name}_scale"
        )
        scale = local(state[f"{name}_scale"])
        exp = local(state[f"{name}_exponent"]) if expand else None
        top_q = torch.full((*scale.shape, 1), torch.finfo(want).max, device=scale.device)
        top = coat.dequantize_groups(top_q.to(want), scale, exp)
        what = f"the largest code ({torch.finfo(want).max:g})"
        _check_top_decodes(top, pid, f"{name}_scale", what)


def _to_fp8(
    m: torch.Tensor, v: torch.Tensor, p: torch.Tensor, group: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """fp32 moments of ``p`` as FP8 states (the optimizer's own quantization)."""
    gs = group["group_size"]
    fp8 = fp8_dtype(group["fp8_format"])
    expand = group["dynamic_range_expansion"]
    rows, cols, gc = layout(p, gs)
    if resolved_format(group) == "log":
        return _to_log(m, v, p, gs)
    state = new_quantized_state(p, group_size=gs, fp8=fp8, expand=expand)
    if group.get("sqrt_second_moment"):
        v = v.sqrt()
    for name, x in (("exp_avg", m), ("exp_avg_sq", v)):
        x2 = torch.nn.functional.pad(x.float().reshape(rows, cols), (0, gc * gs - cols))
        q, scale, k = coat.quantize_groups(
            x2.reshape(-1, gs),
            fp8,
            dynamic_range_expansion=expand,
            keep_nonzero=name == "exp_avg_sq",  # as the step stores v
        )
        state[f"{name}_fp8"].copy_(q.reshape(rows, gc * gs))
        state[f"{name}_scale"].copy_(scale.reshape(rows, gc))
        if k is not None:
            state[f"{name}_exponent"].copy_(k.reshape(rows, gc))
    return state


def _to_log(m: torch.Tensor, v: torch.Tensor, p: torch.Tensor, gs: int) -> dict[str, torch.Tensor]:
    """fp32 moments as ``moment_format="log"`` codes (round-to-nearest; v first, then m)."""
    rows, cols, gc = layout(p, gs)

    def groups(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x.float().reshape(rows, cols), (0, gc * gs - cols)).reshape(
            -1, gs
        )

    vq, amax, k = log_moments.quantize_v(groups(v))
    _, s_inv = log_moments.m_scales(vq, amax, k)
    mq, ms = log_moments.quantize_m(groups(m) * s_inv)
    return {
        "exp_avg_fp8": mq.reshape(rows, gc * gs),
        "exp_avg_scale": ms.reshape(rows, gc),
        "exp_avg_sq_fp8": vq.reshape(rows, gc * gs),
        "exp_avg_sq_scale": amax.reshape(rows, gc),
        "exp_avg_sq_exponent": k.reshape(rows, gc),
    }


def validated_state(
    saved: Any, p: torch.Tensor, group: dict[str, Any], pid: Any
) -> tuple[dict[str, Any], bool]:
    """A checked copy of ``saved`` for ``p`` (tensors on ``p``'s device, dtypes kept).

    Returns ``(state, converted)``; ``converted`` is ``True`` when fp32 moments became FP8.
    Raises :class:`OptimizerStateError` naming the parameter, the entry and the fix.
    """
    if not isinstance(saved, dict):
        raise _fail(pid, None, f"is a {type(saved).__name__}, expected a dict")
    if not saved:
        return {}, False
    if "step" not in saved:
        raise _fail(pid, "step", "is missing")
    out: dict[str, Any] = {"step": _step(saved["step"], pid)}
    if any(k in saved for k in QUANT_KEYS):
        _check_quantized(saved, p, group, pid)
        if resolved_format(group) == "log":
            out.update({k: _to_device(saved[k], p) for k in LOG_LAYOUT})
            return out, False
        out.update({k: _to_device(saved[k], p) for k in QUANT_KEYS if k in saved})
        return out, False
    extra = set(saved) - set(FP32_KEYS) - {"step"}
    if extra:
        hint = " (amsgrad is not supported)" if "max_exp_avg_sq" in extra else ""
        if not any(k in saved for k in FP32_KEYS):
            hint += (
                ": no exp_avg / exp_avg_sq, the state looks like another optimizer's (not "
                "AdamW's or AdamWFp8's); resume it with the optimizer that saved it"
            )
        raise _fail(pid, None, f"unexpected entries {sorted(extra)}{hint}")
    floats = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    for key in FP32_KEYS:
        if key not in saved:
            raise _fail(pid, key, "is missing")
        _check(saved[key], pid, key, tuple(p.shape), floats)
    m, v = (_to_device(saved[k], p).to(torch.float32) for k in FP32_KEYS)
    if not bool(torch.isfinite(local(m)).all()):
        raise _fail(pid, "exp_avg", "holds non-finite values")
    # +inf is a state torch writes (g² overflowed fp32) and reloads: kept in fp32 it stays inf
    # (that element's update is 0, as in torch); quantized, its group saturates to FLT_MAX
    # like a step's. NaN and negative values are no state AdamW writes.
    if bool(torch.isnan(local(v)).any()) or bool((local(v) < 0).any()):
        raise _fail(pid, "exp_avg_sq", "holds negative or NaN values")
    if wants_quantized(p, group) and not is_dtensor(p) and not is_dtensor(m):
        out.update(_to_fp8(m, v, p, group))
        return out, True
    if wants_quantized(p, group) and _sharded_like(m, v, p):
        # FSDP2: each rank converts its own rows (whole groups: a group never straddles a
        # shard), so the sharded state is, bit for bit, the rows one process converts
        out.update(_to_fp8_sharded(m, v, p, group))
        return out, True
    out.update(exp_avg=m.contiguous(), exp_avg_sq=v.contiguous())
    return out, False


def _sharded_like(m: Any, v: Any, p: torch.Tensor) -> bool:
    """``m``, ``v`` and ``p`` are DTensors laid out alike, with whole rows per rank."""
    if not (is_dtensor(p) and is_dtensor(m) and is_dtensor(v) and quantizable_placements(p)):
        return False
    return all(
        t.device_mesh == p.device_mesh
        and tuple(t.placements) == tuple(p.placements)
        and tuple(t.shape) == tuple(p.shape)
        for t in (m, v)
    )


def _to_fp8_sharded(
    m: torch.Tensor, v: torch.Tensor, p: torch.Tensor, group: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """:func:`_to_fp8` of this rank's rows, as DTensors laid out like ``p``."""
    from torch.distributed.tensor import DTensor

    lp, lm, lv = local(p), local(m), local(v)
    rows = lp.shape[0]
    if rows == 0:  # an uneven shard without rows: the layout of one row, cut to none
        shape = (1, *lp.shape[1:])
        one = torch.zeros(shape, dtype=torch.float32, device=lp.device)
        converted = {k: t[:0] for k, t in _to_fp8(one, one, one, group).items()}
    else:
        converted = _to_fp8(lm, lv, lp, group)
    return {
        k: DTensor.from_local(
            t.contiguous(),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=(p.shape[0], t.shape[1]),
            stride=(t.shape[1], 1),
        )
        for k, t in converted.items()
    }


def _to_device(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if type(value) is not torch.Tensor or type(p) is not torch.Tensor:  # DTensor: as given
        return value
    return value.to(device=p.device).contiguous()
