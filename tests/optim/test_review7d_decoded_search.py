"""COAT decoded-domain rounding against a brute-force bracket over every code (review 7d).

The quantizer's bitwise search (int32 codes, one row of decoded values per group) must pick
exactly the code that a brute-force scan of all codes, decoded by ``dequantize_groups``, picks:
``c = max{code <= top : dec(code) <= |x|}``, then up by the nearest (ties down) or stochastic
rule. Swept over every fp32 exponent as group maximum, ranges giving the clamped ``k`` (1/16 and
1024), zeros, subnormal codes, the top code, inf / FLT_MAX and both fp8 formats.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_fp8.numerics import coat

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _sweep(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    exps = torch.arange(-149, 128, dtype=torch.float32)
    base = torch.exp2(exps).unsqueeze(-1)  # every fp32 exponent as the group maximum
    r = torch.rand(len(exps), 40, generator=g)
    out = []
    for width in (1e-7, 1e-3, 0.5, 0.999):  # k = 1024 (clamped) .. moderate
        x = base * (1 - width * r)
        x[:, :2] = 0.0
        x[::2, 3] = -x[::2, 3]
        out.append(x)
    out.append(base * torch.exp2(-torch.rand(len(exps), 40, generator=g) * 250))  # k = 1/16
    special = torch.full((4, 16), 1e-40)
    special[1] = math.inf
    special[2, 0] = 3.0e38
    special[3] = 0.0
    out.append(special)
    out.append(torch.randn(64, 32, generator=g) * torch.exp2(torch.randn(64, 32, generator=g) * 6))
    return out


def _reference_codes(
    x: torch.Tensor, fp8: torch.dtype, bits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude codes by a scan over every code's decoded value (``dequantize_groups``), and
    the groups whose decoded codes are non-decreasing (where the scan is the bracket)."""
    _, scale, k = coat.quantize_groups(x, fp8)
    top = coat.CODE_MAX[fp8]
    codes = torch.arange(top + 1, dtype=torch.uint8).view(fp8)
    lead = scale.shape
    dec = coat.dequantize_groups(codes.expand(*lead, -1).contiguous(), scale, k)  # [..., top+1]
    descent = dec[..., 1:] < dec[..., :-1]
    monotone = ~descent.any(-1)
    # Decoded codes fall only where fast_exp2 clamps A[E] to FLT_MIN (codes that would decode
    # below FLT_MIN: dequantize_groups' doc); |x| >= 4·FLT_MIN lies above all of them.
    assert bool((~descent | (dec[..., :-1] < 4 * coat.FLT_MIN)).all())
    ax = x.float().abs().clamp(max=coat.FLT_MAX)
    below = dec.unsqueeze(-2) <= ax.unsqueeze(-1)
    c = torch.where(below, torch.arange(top + 1), 0).amax(-1)  # the largest code, dec <= |x|
    lo = torch.gather(dec, -1, c)
    hi = torch.gather(dec, -1, (c + 1).clamp(max=top))
    if bits is None:
        up = (ax - lo) > (hi - ax)
    else:
        u = (bits >> coat.DECODED_SR_SHIFT).float() * 2.0 ** -(32 - coat.DECODED_SR_SHIFT)
        up = u * (hi - lo) < ax - lo
    code = torch.where(c >= top, top, c + up.long())
    checked = monotone.unsqueeze(-1) | (ax >= 4 * coat.FLT_MIN)
    return torch.where(x.float().abs() >= coat.FLT_MIN, code, 0), checked


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_codes_match_a_brute_force_scan_of_every_decoded_code(
    fp8: torch.dtype, stochastic: bool
) -> None:
    for i, x in enumerate(_sweep(seed=3)):
        bits = coat.random_bits(torch.tensor(11 + i), x.shape) if stochastic else None
        q, _, k = coat.quantize_groups(x, fp8, stochastic_bits=bits)
        got = (q.view(torch.uint8) & 0x7F).long()
        want, checked = _reference_codes(x, fp8, bits)
        assert int(checked.sum()) > 0.7 * checked.numel()
        bad = (got != want) & checked
        assert not bool(bad.any()), (fp8, stochastic, i, int(bad.sum()), k.min(), k.max())


@pytest.mark.parametrize("fp8", FORMATS)
def test_sweep_reaches_both_exponent_clamps_and_subnormal_and_top_codes(fp8: torch.dtype) -> None:
    ks, codes = [], []
    for x in _sweep(seed=3):
        q, _, k = coat.quantize_groups(x, fp8)
        ks.append(k.flatten())
        codes.append((q.view(torch.uint8) & 0x7F).flatten())
    k_all, c_all = torch.cat(ks), torch.cat(codes)
    assert float(k_all.max()) == coat.EXPONENT_MAX
    if fp8 == torch.float8_e4m3fn:  # E5M2 would need a range of 2^496: beyond fp32
        assert float(k_all.min()) == coat.EXPONENT_MIN
    sub = 1 << coat.CODE_MANTISSA_BITS[fp8]
    assert bool(((c_all > 0) & (c_all < sub)).any()), "no subnormal code exercised"
    assert bool((c_all == coat.CODE_MAX[fp8]).any()), "top code not exercised"


@pytest.mark.slow
def test_fast_exp2_is_monotone_over_every_fp32_fraction() -> None:
    """fast_exp2(y) = poly(frac)·2^floor(y): monotone iff poly's fp32 result is non-decreasing
    over every fp32 frac in [0, 1] and poly(1) <= 2. The compiled search counts the binade
    starts ``A[E]·B[0]`` instead of searching them bitwise, which relies on this."""
    prev = None
    for start in [0] + [(e + 127) << 23 for e in range(-126, 0)]:  # subnormals, then binades
        f = torch.arange(start, start + (1 << 23), dtype=torch.int32).view(torch.float32)
        p = (coat._horner(f, coat.EXP2_COEFFS) + 1.0).view(torch.int32)
        assert bool((p[1:] >= p[:-1]).all()), start
        assert prev is None or int(p[0]) >= prev, start
        prev = int(p[-1])
    at_one = float(coat._horner(torch.ones(1), coat.EXP2_COEFFS)[0]) + 1.0
    assert float(coat._horner(torch.zeros(1), coat.EXP2_COEFFS)[0]) + 1.0 == 1.0
    assert at_one <= 2.0 and int(torch.tensor([at_one]).view(torch.int32)) >= prev


@pytest.mark.slow
@pytest.mark.parametrize("fp8", FORMATS)
def test_compiled_codes_equal_the_eager_search_on_the_sweep(fp8: torch.dtype) -> None:
    """The compiled quantizer (exponent field by counting) picks the eager search's codes."""
    compiled = torch.compile(
        lambda x, b: coat.quantize_groups(x, fp8, stochastic_bits=b), dynamic=True
    )
    for i, x in enumerate(_sweep(seed=5)):
        for bits in (None, coat.random_bits(torch.tensor(i), x.shape)):
            q, s, k = coat.quantize_groups(x, fp8, stochastic_bits=bits)
            q2, s2, k2 = compiled(x, bits)
            assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)), (fp8, i)
            assert torch.equal(s, s2) and torch.equal(k, k2)
