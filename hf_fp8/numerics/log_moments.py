"""The ``"log"`` moment format of :class:`hf_fp8.optim.AdamWFp8` (pure torch functions).

Both Adam moments in 8 bits per element, groups of ``group_size`` consecutive elements,
with no ``log2`` / ``exp2`` anywhere: every operation is an fp32 or int32 operation on the
bit pattern of a float, so a C kernel vectorizes it and reproduces it bit for bit.

**Second moment** ``v >= 0``: an unsigned 8-bit code ``c`` (0 = zero, 1..255) uniform in
Mitchell's logarithm ``L(x) = bits(x) / 2^23 - 127`` (= ``E + μ`` for ``x = 2^E·(1 + μ)``),
i.e. an unsigned E4M4-like float grid (the sign bit of an fp8 code is a mantissa bit here),
stretched per group by COAT's exponent ``k``::

    t = 255 + 16·k·(L(|x|) - L(amax))       (fp32: (bits(x) - bits(amax)) · (k·2^-19) + 255)
    c = round(t)   or  floor(t + u)         (stochastic rounding, u uniform from a hash)
    k = floor(254 / (L(amax) - L(amin))) / 16, clamped to [1/16, 1024]  (1: constant group)
    x̂ = from_bits(bits(amax) + round((c - 255) · (2^19 / k)))      (0 for c = 0)

so the group's range ``amax / amin`` fills the 254 non-zero codes (``k`` is COAT's power:
``16·k`` codes per octave of ``x``). Stochastic rounding is unbiased in the value domain:
within an octave ``x̂`` is linear in ``c``.

**First moment** ``m``: ``m' = m · 2^-e`` with ``2^e ≈ sqrt(v̂)`` read from the *stored* code
``c`` of the same element's second moment (half its Mitchell log, floored)::

    e = max(floor(c · (2^-5 / k) + L(amax) / 2 - 255 · (2^-5 / k)), -63)

then int8 absmax per group: ``q = round(m' · (127 / amax'))``, ``scale = amax' / 127``,
``m̂ = (q · scale) · 2^e``. Scaling by a power of two is exact, and ``m / sqrt(v)`` (Adam's
update direction) has a far smaller range within a group than ``m``, so linear int8 codes
resolve it better than fp8 codes of ``m`` (measured: ``benchmarks/bench_optim_oracle.py``).

**Stochastic rounding** draws ``u = (((key + i) · 0x9E3779B1) mod 2^32 >> 8) · 2^-24`` for
element ``i`` (Fibonacci hashing: one multiply). The key of a step is :func:`time_key`: a full
hash of seed, parameter and moment (:func:`hf_fp8.numerics.coat.stream_key` at step 0) plus
the step times :data:`TIME_KEY`, so that one element's threshold moves by a fixed irrational
fraction (√2 - 1) every step: a low-discrepancy sequence in time instead of independent
draws. With β2 = 0.999 the second moment moves by ~0.1 % a step against a code step of a
few %, so it is rounded against nearly the same threshold position many steps running;
thresholds spread evenly over those steps make its rounding errors cancel instead of adding
up as a random walk (oracle: ``benchmarks/results/optim_oracle_ld.json``).

An infinite ``v`` (``g²`` overflowed fp32) saturates the group's ``amax`` to FLT_MAX (the
element takes code 255): the stored state stays finite. Likewise ``m'``'s group ``amax``
saturates to :data:`M_MAX` (2^63: an infinite ``m`` from an infinite gradient, or a huge ``m``
over a tiny ``v`` in a converted state, where ``m·2^-e`` overflows): the element takes code
±127 and every code decodes finite (``127 · scale · 2^e ≤ 2^63 · 2^64 < FLT_MAX``), where an
infinite scale decoded the whole group to NaN (R8). A NaN element (a NaN gradient) is left
out of both maxima and gets code 0 in both moments: only that element restarts (its weight is
NaN, as in ``torch.optim.AdamW``), the scales stay finite and the state reloads.
Groups whose ``amax`` is below ``FLT_MIN`` (``v``) or :data:`M_MIN` (``m'``) store zeros.
"""

from __future__ import annotations

import torch

from hf_fp8.numerics.coat import EXPONENT_MAX, EXPONENT_MIN, EXPONENT_STEPS, MASK32, mul32

V_CODE_MAX = 255  # unsigned codes of v: 0 = zero, 1..255
V_STEPS = 16  # codes per Mitchell octave at k = 1
V_RANGE_STEPS = (V_CODE_MAX - 1) * EXPONENT_STEPS / V_STEPS  # 254: k = floor(this / range) / 16
V_ENC = V_STEPS / 2.0**23  # k·V_ENC: codes per bit-pattern unit (k·2^-19, exact)
V_DEC = 2.0**23 / V_STEPS  # V_DEC / k: bit-pattern units per code (2^19 / k)
M_CODE_MAX = 127  # int8 codes of m' = m·2^-e: -127..127
M_MIN = 2.0**-100  # groups of m' with a smaller amax store zeros (keeps 127/amax finite)
M_MAX = 2.0**63  # m''s amax saturates here: 127·scale·2^e (e <= 64) stays below FLT_MAX
INF_BITS = 0x7F800000  # larger bit patterns (of a magnitude) are NaN
FLT_MIN_BITS = 0x00800000
SR_SHIFT = 8  # stochastic rounding uses the top 24 bits of the hash: u = (h >> 8)·2^-24
WEYL = 0x9E3779B1  # 2^32 / golden ratio: Fibonacci hashing of the element counter
TIME_STRIDE = 0x6A09E667  # 2^32 · (√2 - 1): one element's threshold advances this per step
TIME_KEY = TIME_STRIDE * pow(WEYL, -1, 2**32) % 2**32  # the same advance in key units
E_MAX = 63  # e >= -63 in the m normalization 2^e (and e <= 64 by construction: 2^±e normal)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _float(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32)


def _rdiv(c: float, x: torch.Tensor) -> torch.Tensor:
    """``c / x`` as one correctly rounded fp32 division (``c / tensor`` in torch is
    ``x.reciprocal() * c``: two roundings, not the kernel's)."""
    return torch.full_like(x, c).div(x)


def sr_bits(key: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """int64 ``((key + i) · WEYL) mod 2^32`` for the flat index ``i`` of every element."""
    n = 1
    for d in shape:
        n *= d
    e = torch.arange(n, dtype=torch.int64, device=key.device).view(shape)
    return mul32((e + key) & MASK32, WEYL)


def time_key(base: int, step: int) -> int:
    """uint32 key of ``step`` for a moment whose step-0 key is ``base``: element ``i`` draws
    ``((base + i)·WEYL + step·TIME_STRIDE) mod 2^32`` (``TIME_KEY·WEYL ≡ TIME_STRIDE``), the
    same formula :func:`sr_bits` and the C kernel compute from any key."""
    return (base + step * TIME_KEY) & MASK32


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """fp32 in [0, 1) from int64 random bits (uint32 values): ``(bits >> 8) · 2^-24``."""
    return (bits >> SR_SHIFT).to(torch.float32) * (2.0**-24)


def v_exponent(vmax_bits: torch.Tensor, vmin_bits: torch.Tensor) -> torch.Tensor:
    """COAT's ``k`` of each group from the bit patterns of its max and min non-zero ``|v|``.

    ``vmin_bits`` is ``0x7F800000`` (inf) where a group has no non-zero element."""
    valid = vmax_bits >= FLT_MIN_BITS
    lo = torch.minimum(vmin_bits, vmax_bits)
    lr = (vmax_bits - lo).to(torch.float32) * (2.0**-23)
    expand = valid & (lr > 0)
    steps = torch.floor(_rdiv(V_RANGE_STEPS, torch.where(expand, lr, torch.ones_like(lr))))
    k = torch.where(expand, steps * (1.0 / EXPONENT_STEPS), torch.ones_like(lr))
    return k.clamp(EXPONENT_MIN, EXPONENT_MAX)


def quantize_v(
    v: torch.Tensor, stochastic_bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``v >= 0`` (fp32 ``[G, group_size]``) to ``(codes uint8, amax fp32 [G], k fp32 [G])``."""
    b = _bits(v.float()) & 0x7FFFFFFF
    number = b <= INF_BITS  # NaN: not in vmax, code 0
    vmax = torch.where(number, b, torch.zeros_like(b)).amax(dim=-1)
    vmax = torch.where(vmax == INF_BITS, 0x7F7FFFFF, vmax)  # an overflowed v: FLT_MAX
    inf = torch.full_like(b, INF_BITS)
    vmin = torch.where(b >= FLT_MIN_BITS, b, inf).amin(dim=-1)  # NaN bits > inf: never min
    k = v_exponent(vmax, vmin)
    t = (b - vmax.unsqueeze(-1)).to(torch.float32) * (k * V_ENC).unsqueeze(-1) + float(V_CODE_MAX)
    c = torch.round(t) if stochastic_bits is None else torch.floor(t + uniform(stochastic_bits))
    c = c.clamp(0.0, float(V_CODE_MAX))
    c = torch.where((b >= FLT_MIN_BITS) & number, c, torch.zeros_like(c))
    amax = torch.where(vmax >= FLT_MIN_BITS, vmax, torch.zeros_like(vmax))
    return c.to(torch.uint8), _float(amax), k


def offset_floor(amax_bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``-bits(amax)`` per group (``[G, 1]``), where the decoded offsets are clamped: an
    offset below it gives ``|b| = |bits(amax) + round(offset)| <= 64 < FLT_MIN_BITS`` (the
    int32 to fp32 rounding of ``bits(amax) < 2^31`` moves it by 64 units at most), so the
    element decodes to 0 (the old fixed floor, 128 octaves below ``amax``, decoded such codes
    to ``amax·2^-128``: ~1.0 next to a saturated FLT_MAX), and ``|round(offset)| < 2^31``
    stays an int32 for any ``k``. Offsets above it are unchanged: bit-identical decodes."""
    return -(amax_bits.to(torch.float32).unsqueeze(-1))


def dequantize_v_bits(codes: torch.Tensor, amax: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bit patterns (int32) of ``v̂``; 0 where the code is 0 or ``v̂`` would be below FLT_MIN."""
    c = codes.to(torch.int32)
    step = _rdiv(V_DEC, k.float())
    a = _bits(amax.float())
    off = torch.maximum((c - V_CODE_MAX).to(torch.float32) * step.unsqueeze(-1), offset_floor(a))
    b = a.unsqueeze(-1) + torch.round(off).to(torch.int32)
    keep = (c != 0) & (b >= FLT_MIN_BITS)
    return torch.where(keep, b, torch.zeros_like(b))


def dequantize_v(codes: torch.Tensor, amax: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """fp32 ``v̂`` of uint8 ``codes`` ``[G, group_size]`` with per-group ``amax`` and ``k``."""
    return _float(dequantize_v_bits(codes, amax, k))


def m_scales(
    codes: torch.Tensor, amax: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2^e, 2^-e)`` per element from v's uint8 ``codes`` and its group's ``amax`` and ``k``:
    ``e = max(floor(c · slope + offset), -63)``, ``slope = 2^-5 / k``,
    ``offset = L(amax) / 2 - 255 · slope`` (``e <= 64`` always: ``L(amax) / 2 <= 64``)."""
    slope = _rdiv(2.0**-5, k.float())
    half_log = (_bits(amax.float()) - 0x3F800000).to(torch.float32) * (2.0**-24)
    offset = half_log - slope * float(V_CODE_MAX)
    h = codes.to(torch.float32) * slope.unsqueeze(-1) + offset.unsqueeze(-1)
    e = torch.floor(h).clamp(min=-float(E_MAX)).to(torch.int32)
    return _float((e + 127) << 23), _float((127 - e) << 23)


def quantize_m(
    m_norm: torch.Tensor, stochastic_bits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``m' = m·2^-e`` (fp32 ``[G, group_size]``) to ``(codes int8, scale fp32 [G])``.

    ``amax`` leaves NaN out and saturates to :data:`M_MAX`; NaN elements get code 0."""
    a = m_norm.abs()
    number = a == a
    amax = torch.where(number, a, torch.zeros_like(a)).amax(dim=-1).clamp(max=M_MAX)
    valid = amax >= M_MIN
    inv = _rdiv(float(M_CODE_MAX), torch.where(valid, amax, torch.ones_like(amax)))
    t = m_norm * inv.unsqueeze(-1)
    if stochastic_bits is None:
        q = torch.round(t)
    else:
        q = torch.copysign(torch.floor(t.abs() + uniform(stochastic_bits)), t)
    q = q.clamp(-float(M_CODE_MAX), float(M_CODE_MAX))
    q = torch.where(valid.unsqueeze(-1) & number, q, torch.zeros_like(q))
    scale = torch.where(
        valid, amax.div(torch.full_like(amax, float(M_CODE_MAX))), torch.zeros_like(amax)
    )
    return q.to(torch.int8), scale


def dequantize_m(codes: torch.Tensor, scale: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 ``m̂ = (q · scale) · 2^e`` (``s = 2^e`` per element, from :func:`m_scales`)."""
    return (codes.to(torch.float32) * scale.unsqueeze(-1)) * s
