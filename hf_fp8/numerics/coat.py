"""COAT group quantization of optimizer moments (pure torch functions, no state).

From "COAT: Compressing Optimizer States and Activation for Memory-Efficient FP8
Training" (Xi et al., 2024). A tensor is cut into groups along its **last dimension**
(``x`` of shape ``[..., group_size]``); every group gets fp32 metadata of shape
``x.shape[:-1]``. ``F`` below is the largest fp8 value (448 for E4M3, 57344 for E5M2).

Plain per-group absmax (``dynamic_range_expansion=False``)::

    scale = amax / F ;   q = cast(x / scale) ;   x ≈ q · scale

With COAT's dynamic range expansion each group is raised to a power ``k`` that stretches
its range ``amax / amin`` (``amin``: smallest non-zero magnitude) onto ``F² / 2``::

    k = floor(16 · log2(F² / 2) / log2(amax / amin)) / 16        (k = 1: constant or zero group)
    q = cast(sign(x) · F · (|x| / amax)^k)
    x ≈ sign(q) · amax · (|q| / F)^(1/k)

The paper writes the same map with a centre ``c = sqrt(amax·amin)`` and a scale
``s = (amax/c)^k / F``: ``q = sign(x)·(|x|/c)^k / s`` and ``x = sign(q)·(|q|·s)^(1/k)·c``.
``c`` cancels (``(|x|/c)^k / s = F·(|x|/amax)^k``), so storing ``amax`` (as the usual
``scale = amax / F``) and ``k`` is exact and saves one fp32 per group. Working with
``|x| / amax ≤ 1`` also avoids the traps of the literal form: ``amax·amin`` underflows for
small moments (0/0 = NaN) and ``(amax/c)^k`` over- or underflows for large ``k``.

Conventions and guards:

* Magnitudes below the smallest normal fp32 (``FLT_MIN`` ≈ 1.2e-38) count as zero. A group
  whose ``amax`` is below it (all-zero groups included) gets zero codes, ``k = 1``, and
  dequantizes to exact zeros.
* ``k`` is a multiple of 1/16 clamped to ``[EXPONENT_MIN, EXPONENT_MAX]``: the lower bound
  keeps ``1/k`` finite when a group's range exceeds the fp8 range, the upper bound keeps
  nearly constant groups (k → ∞) away from rounding blow-up.
* Values are clamped to ``±F`` before the cast (E4M3 has no inf: inf → NaN).
* An infinite ``amax`` (a moment that overflowed fp32: ``g² > FLT_MAX`` for ``|g| > 1.8e19``)
  saturates to ``FLT_MAX``: the scale stays finite (a saved state stays loadable), the
  element takes F's code and decodes to about ``FLT_MAX``; the group keeps working.
* A NaN element (a NaN gradient) is left out of its group's ``amax`` and ``amin`` and gets
  the zero code: only that element's moment restarts (its weight is NaN, as in
  ``torch.optim.AdamW``); the rest of the group and the scale stay as they were without it.
* Plain format, ``keep_nonzero=True`` (the second moment): a non-zero element (``|x| ≥
  FLT_MIN``) never gets the zero code, it rounds up to the smallest subnormal code
  (``amax·2^-9/448`` for E4M3). Plain E4M3 spans only ~2.3e5 below ``amax``; a ``v`` rounded
  to 0 under a surviving ``m`` made the update ``m / eps`` (R8: 2,367x AdamW's beside one
  1000x outlier column). Rounding up overestimates a tiny ``v``: the update of that element
  is smaller, never unbounded. With expansion no non-zero element reaches the zero code
  (``F·(amin/amax)^k ≥ 2/F``, two subnormal steps), so the option changes nothing there.
* ``log2`` / ``exp2`` are :func:`fast_log2` / :func:`fast_exp2`: fixed polynomial
  approximations (relative error < 3e-6, far below the fp8 step of 6%) written with plain
  fp32 operations only, so that a fused CPU kernel reproduces this module bit for bit.

Stochastic rounding (optional, ``stochastic_bits=``): the value about to be cast is first
rounded to a neighbouring fp8 value with probability proportional to its distance, so that
small, steady changes of a moment (β2 = 0.999 moves ``v`` by 0.1 % a step, one E4M3 step is
6–12 %) are kept in expectation instead of being rounded away every step. The random bits of
element ``e`` are the top bits of ``((key + e) · SR_WEYL) mod 2^32``: ``key`` is a lowbias32
hash (:func:`hash32_int`, Wellons) of (seed, step, parameter, moment), so an element draws
independent uniform thresholds from step to step, while the elements of one step form a
randomly shifted Weyl sequence (evenly spread thresholds; one multiply-add per element instead
of a hash). int64 arithmetic that never overflows keeps the C kernel, ``torch.compile`` and
this reference on the same bits.

The functions avoid data-dependent Python branches so that ``torch.compile`` can fuse
them; the optimizer runs them eagerly as its reference step.
"""

from __future__ import annotations

import math

import torch

from hf_fp8.numerics.formats import fp8_max

EXPONENT_MIN = 1.0 / 16.0
EXPONENT_MAX = 1024.0
EXPONENT_STEPS = 16.0  # k is a multiple of 1 / EXPONENT_STEPS
FLT_MIN = 2.0**-126  # smallest normal float32; smaller magnitudes count as zero
FLT_MAX = 3.4028234663852886e38  # largest float32: an infinite group maximum saturates to it

# log2(1 + t) ≈ t·(c0 + t·(c1 + …)) on t ∈ [0, 1), max abs error 2.5e-6.
LOG2_COEFFS = (
    1.442534755380041,
    -0.7180332033899721,
    0.45715613082188805,
    -0.27733722319424214,
    0.12146852561508568,
    -0.025790712011052968,
)
# 2^f - 1 ≈ f·(c0 + f·(c1 + …)) on f ∈ [0, 1), max relative error 4.2e-6.
EXP2_COEFFS = (
    0.693018526391272,
    0.24144552149469578,
    0.05195051991394458,
    0.013581263456585196,
)


# Stochastic rounding: random bits below the fp8 mantissa (20 for E4M3, 21 for E5M2), the
# smallest normal fp8 magnitude and the subnormal spacing (2^-9 for E4M3, 2^-16 for E5M2).
SR_DROP_BITS = {torch.float8_e4m3fn: 20, torch.float8_e5m2: 21}
SR_MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e5m2: 2.0**-14}
SR_SUBNORMAL_STEPS = {torch.float8_e4m3fn: 512.0, torch.float8_e5m2: 65536.0}
# the value of the smallest non-zero code (1 / SR_SUBNORMAL_STEPS), the one keep_nonzero writes
MIN_SUBNORMAL = {dtype: 1.0 / steps for dtype, steps in SR_SUBNORMAL_STEPS.items()}
HASH_MUL = (0x7FEB352D, 0x846CA68B)  # lowbias32 multipliers
SR_WEYL = 0x9E3779B1  # 2^32 / golden ratio: the element counter's multiplier
MASK32 = 0xFFFFFFFF


def hash32_int(x: int) -> int:
    """Wellons' lowbias32 on a Python int (uint32 in, uint32 out)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * HASH_MUL[0]) & MASK32
    x ^= x >> 15
    x = (x * HASH_MUL[1]) & MASK32
    return x ^ (x >> 16)


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2^32`` for int64 ``x`` in [0, 2^32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def stream_key(seed: int, step: int, index: int, moment: int) -> int:
    """The uint32 key of one moment (0: exp_avg, 1: exp_avg_sq) of parameter ``index`` at
    ``step``; element ``e`` of it draws ``((key + e) · SR_WEYL) mod 2^32``."""
    h = hash32_int(seed ^ 0x5BD1E995)
    h = hash32_int(h ^ (step & MASK32))
    h = hash32_int(h ^ ((step >> 32) & MASK32))
    return hash32_int(h ^ ((2 * index + moment) & MASK32))


def random_bits(key: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """int64 ``((key + e) · SR_WEYL) mod 2^32`` for the flat index ``e`` of every element of
    ``shape`` (:func:`stochastic_round_magnitude` uses its top bits)."""
    n = math.prod(shape)
    e = torch.arange(n, dtype=torch.int64, device=key.device).view(shape)
    return mul32((e + key) & MASK32, SR_WEYL)


def stochastic_round_magnitude(
    a: torch.Tensor, bits: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """Round fp32 magnitudes ``a`` (``0 ≤ a ≤ F``) to fp8-representable values, up with
    probability proportional to the distance (``bits``: int64 uint32 random bits from
    :func:`random_bits`, the top ones used).

    Normal range: add random bits below the fp8 mantissa to the fp32 pattern and truncate.
    Subnormal range: ``floor(a / spacing + u) · spacing`` with ``u`` uniform in [0, 1).
    The result is clamped to ``F`` (rounding up from the largest value).
    """
    drop = SR_DROP_BITS[fp8_dtype]
    low = bits >> (32 - drop)
    ab = a.view(torch.int32)
    normal = ((ab + low.to(torch.int32)) & ~((1 << drop) - 1)).view(torch.float32)
    steps = SR_SUBNORMAL_STEPS[fp8_dtype]
    u = low.to(torch.float32) * (2.0**-drop)
    sub = torch.floor(a * steps + u) * (1.0 / steps)
    out = torch.where(a < SR_MIN_NORMAL[fp8_dtype], sub, normal)
    return out.clamp(max=fp8_max(fp8_dtype))


def _horner(t: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """``t · (c0 + t·(c1 + …))`` evaluated innermost first, one fp32 op at a time."""
    acc = t * coeffs[-1] + coeffs[-2]
    for c in reversed(coeffs[:-2]):
        acc = acc * t + c
    return acc * t


def fast_log2(x: torch.Tensor) -> torch.Tensor:
    """Approximate ``log2(x)`` of a float32 tensor of normal, finite, positive values."""
    bits = x.view(torch.int32)
    exponent = ((bits >> 23) - 127).to(torch.float32)
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # in [1, 2)
    return exponent + _horner(mantissa - 1.0, LOG2_COEFFS)


def fast_exp2(y: torch.Tensor) -> torch.Tensor:
    """Approximate ``2**y`` for float32 ``y ≤ 127``; ``y < -126`` gives ``FLT_MIN``."""
    y = y.clamp(min=-126.0)
    whole = torch.floor(y)
    frac = y - whole
    poly = _horner(frac, EXP2_COEFFS) + 1.0  # in [1, 2]
    return (poly.view(torch.int32) + (whole.to(torch.int32) << 23)).view(torch.float32)


def target_log2_range(fp8_dtype: torch.dtype) -> float:
    """``log2(F² / 2)``: the dynamic range COAT expands each group onto (16.6 for E4M3)."""
    return 2.0 * math.log2(fp8_max(fp8_dtype)) - 1.0


def expansion_exponent(
    amax: torch.Tensor, amin: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """COAT's exponent ``k`` per group from its ``amax`` and smallest non-zero ``|x|``.

    ``k = floor(16 · log2(F²/2) / log2(amax/amin)) / 16``, ``k = 1`` for constant-magnitude
    or zero groups (``amin = inf``), clamped to ``[EXPONENT_MIN, EXPONENT_MAX]``.
    """
    one = torch.ones_like(amax)
    valid = amax >= FLT_MIN
    log_range = fast_log2(torch.where(valid, amax, one)) - fast_log2(torch.where(valid, amin, one))
    expand = log_range > 0
    steps = torch.where(expand, log_range, one).reciprocal() * (
        EXPONENT_STEPS * target_log2_range(fp8_dtype)
    )
    k = torch.where(expand, torch.floor(steps) * (1.0 / EXPONENT_STEPS), one)
    return k.clamp(EXPONENT_MIN, EXPONENT_MAX)


def quantize_groups(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    dynamic_range_expansion: bool = True,
    stochastic_bits: torch.Tensor | None = None,
    keep_nonzero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x`` (``[..., group_size]``) per group of its last dimension.

    Returns ``(q, scale, exponent)``: ``q`` in ``fp8_dtype`` with the shape of ``x``,
    fp32 ``scale = amax / F`` and, with expansion, fp32 ``exponent`` (``k``), both of shape
    ``x.shape[:-1]``. Without expansion ``exponent`` is ``None``. ``stochastic_bits`` (int64,
    the shape of ``x``): stochastic instead of round-to-nearest casts (see the module doc).
    ``keep_nonzero`` (plain format, ``x ≥ 0``: a second moment): non-zero elements get at
    least the smallest non-zero code. NaN elements get the zero code and no say in ``amax``.
    """
    fmax = fp8_max(fp8_dtype)
    xf = x.float()
    ax = xf.abs()
    zero = torch.zeros_like(xf)
    number = ax == ax  # False for NaN: left out of amax, zero code
    amax = torch.where(number, ax, zero).amax(dim=-1)
    amax = torch.where(amax == math.inf, FLT_MAX, amax)  # an overflowed moment saturates
    scale = amax / fmax
    valid = (amax >= FLT_MIN).unsqueeze(-1)
    if not dynamic_range_expansion:
        safe_scale = torch.where(valid, scale.unsqueeze(-1), torch.ones_like(xf))
        q = torch.where(valid & number, xf / safe_scale, zero).clamp(-fmax, fmax)
        if stochastic_bits is not None:
            q = torch.copysign(stochastic_round_magnitude(q.abs(), stochastic_bits, fp8_dtype), q)
        codes = q.to(fp8_dtype)
        if keep_nonzero:  # zero code (0x00) of a non-zero x: the smallest subnormal (0x01)
            b = codes.view(torch.uint8)
            b = torch.where((b == 0) & (ax >= FLT_MIN), torch.ones_like(b), b)
            codes = b.view(fp8_dtype)
        return codes, scale, None
    nonzero = ax >= FLT_MIN
    amin = torch.where(nonzero, ax, torch.full_like(ax, math.inf)).amin(dim=-1)
    k = expansion_exponent(amax, amin, fp8_dtype)
    log_amax = fast_log2(torch.where(amax >= FLT_MIN, amax, torch.ones_like(amax)))
    # log2(F · (|x| / amax)^k) = (log2|x| - log2 amax) · k + log2 F
    y = (fast_log2(torch.where(nonzero, ax, torch.ones_like(ax))) - log_amax.unsqueeze(-1)) * (
        k.unsqueeze(-1)
    ) + math.log2(fmax)
    mag = torch.where(nonzero, fast_exp2(y), zero).clamp(max=fmax)
    if stochastic_bits is not None:
        mag = stochastic_round_magnitude(mag, stochastic_bits, fp8_dtype)
    return torch.copysign(mag, xf).to(fp8_dtype), scale, k


# fp8 code layout: mantissa bits, exponent bias and the mantissa field of the largest value F.
CODE_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
CODE_EXPONENT_BIAS = {torch.float8_e4m3fn: 7, torch.float8_e5m2: 15}
CODE_TOP_MANTISSA = {torch.float8_e4m3fn: 6, torch.float8_e5m2: 3}
DECODE_Y_MAX = 127.99999237060547  # largest fp32 below 128: fast_exp2 stays finite


def decode_log2_tables(fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The constant fp32 tables of the factored COAT decode (see :func:`dequantize_groups`).

    A code of exponent field ``E`` and mantissa field ``j`` has
    ``log2|q| = E - bias + L(1 + j/2^mb)`` (``E ≥ 1``) or ``1 - bias - mb + L(j)`` (``E = 0``),
    ``L`` = :func:`fast_log2`. Split as ``ea[E] + db[i]`` (``i = j``: normal, ``i = 2^mb + j``:
    subnormal): ``ea[E]`` is the log2 of mantissa ``t`` (F's mantissa field) of exponent field
    ``E`` (the largest subnormal for ``E = 0``), so that the largest ``ea`` is ``L(F)``, and
    ``db[i]`` the offset of ``j`` from it: ``≤ 0`` except ``j > t`` (E4M3's ``j = 7``:
    ``db = 0.0995``). Returns ``(ea [2^(7-mb)], db [2^(mb+1)])``.
    """
    mb, bias = CODE_MANTISSA_BITS[fp8_dtype], CODE_EXPONENT_BIAS[fp8_dtype]
    top = CODE_TOP_MANTISSA[fp8_dtype]
    nj = 1 << mb
    j = torch.arange(nj, dtype=torch.float32)
    l_norm = fast_log2(j * (1.0 / nj) + 1.0)  # L(1 + j/2^mb): j/2^mb + 1 is exact
    l_sub = fast_log2(torch.where(j > 0, j, torch.ones_like(j)))  # L(j), j = 0 unused
    e = torch.arange(1 << (7 - mb), dtype=torch.float32)
    ea = torch.where(e > 0, (e - bias) + l_norm[top], (1.0 - bias - mb) + l_sub[-1])
    db = torch.cat([l_norm - l_norm[top], l_sub - l_sub[-1]])
    return ea, db


def decode_tables(
    scale: torch.Tensor, exponent: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-group decode tables ``A`` (``[..., 2^(7-mb)]``) and ``B`` (``[..., 2^(mb+1)]``)
    of :func:`dequantize_groups` from the stored ``scale`` and ``exponent`` (``[...]``)."""
    fmax = fp8_max(fp8_dtype)
    amax = scale * fmax
    inv_k = exponent.reciprocal()
    bias = fast_log2(torch.where(amax >= FLT_MIN, amax, torch.ones_like(amax))) - inv_k * (
        math.log2(fmax)
    )
    ea, db = (t.to(scale.device) for t in decode_log2_tables(fp8_dtype))
    ik = inv_k.unsqueeze(-1)
    table_a = fast_exp2((ea * ik + bias.unsqueeze(-1)).clamp(max=DECODE_Y_MAX))
    table_b = fast_exp2(db * ik)
    return table_a, table_b


def dequantize_groups(
    q: torch.Tensor,
    scale: torch.Tensor,
    exponent: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: ``q · scale`` or ``sign(q)·amax·(|q|/F)^(1/k)``.

    With expansion, ``amax·(|q|/F)^(1/k) = 2^(log2|q|·(1/k) + b)``, ``b = L(amax) - log2F/k``,
    factored per code as ``A[E] · B[i]`` from :func:`decode_log2_tables`::

        A[E] = fast_exp2(min(ea[E]·(1/k) + b, DECODE_Y_MAX)),   B[i] = fast_exp2(db[i]·(1/k))

    one row of 2^(7-mb) and one of 2^(mb+1) values per group, so that an element costs two
    table reads and one multiplication instead of a log2 and an exp2 (relative error < 1.5e-5
    against the exact power, about twice the single fast_exp2's). ``A ≤ amax·(1 + 4e-5)``
    never overflows; ``B ≤ 2^(0.0995/k) ≤ 3``, so an ``A`` clamped to FLT_MIN (a group of
    moments near 1e-38) decodes below 3·FLT_MIN. Zero and non-finite codes decode to ±0.
    """
    qf = q.float()
    if exponent is None:
        return (qf * scale.unsqueeze(-1)).to(dtype)
    mb = CODE_MANTISSA_BITS[q.dtype]
    table_a, table_b = decode_tables(scale, exponent, q.dtype)
    a = q.view(torch.uint8).to(torch.int64) & 0x7F
    e = a >> mb
    j = a & ((1 << mb) - 1)
    i = torch.where(e == 0, j + (1 << mb), j)
    lead = q.shape[:-1]
    mag = torch.gather(table_a.expand(*lead, -1), -1, e) * torch.gather(
        table_b.expand(*lead, -1), -1, i
    )
    valid = (a != 0) & torch.isfinite(qf)
    mag = torch.where(valid, mag, torch.zeros_like(mag))
    return torch.copysign(mag, qf).to(dtype)
