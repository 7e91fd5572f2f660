"""The factored COAT decode (two per-group tables, ``A[E] · B[j]``) against float64 math and
against the decode of the previous version (one log2 and one exp2 per code), so that states
saved before the change still decode within a stated tolerance."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fp8.numerics import coat

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def every_code_groups(dtype: torch.dtype, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Each row holds all 256 codes (two groups of 128) with its own amax and k."""
    g = torch.Generator().manual_seed(seed)
    q = torch.arange(256, dtype=torch.uint8).repeat(rows, 1).view(dtype).view(rows * 2, 128)
    amax = 10 ** torch.empty(rows * 2).uniform_(-30, 30, generator=g)
    k = torch.floor(torch.empty(rows * 2).uniform_(1, 16 * 16, generator=g)) / 16
    return q, amax / coat.fp8_max(dtype), k


def exact_decode(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``sign(q)·amax·(|q|/F)^(1/k)`` in float64; zero and non-finite codes give 0."""
    fmax = coat.fp8_max(q.dtype)
    qd = q.float().double()
    aq = qd.abs().nan_to_num(0.0, posinf=0.0)
    amax = scale.double().unsqueeze(-1) * fmax
    return torch.sign(qd.nan_to_num(0.0)) * amax * (aq / fmax) ** (1 / k.double().unsqueeze(-1))


def legacy_decode(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The decode of the previous version: ``fast_exp2(fast_log2|q|·(1/k) + b)`` per code."""
    fmax = coat.fp8_max(q.dtype)
    qf = q.float()
    amax = scale * fmax
    inv_k = k.reciprocal()
    one = torch.ones_like(amax)
    bias = coat.fast_log2(torch.where(amax >= coat.FLT_MIN, amax, one)) - inv_k * math.log2(fmax)
    aq = qf.abs()
    nonzero = aq > 0
    y = coat.fast_log2(torch.where(nonzero, aq, torch.ones_like(aq))) * inv_k.unsqueeze(-1)
    mag = torch.where(nonzero, coat.fast_exp2(y + bias.unsqueeze(-1)), torch.zeros_like(aq))
    return torch.copysign(mag, qf)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_every_code_decodes_within_1_5e_5_of_float64(dtype):
    q, scale, k = every_code_groups(dtype, 64, seed=0)
    got = coat.dequantize_groups(q, scale, k).double()
    want = exact_decode(q, scale, k)
    normal = want.abs() >= coat.FLT_MIN * 4  # A clamped to FLT_MIN below: a separate bound
    rel = ((got - want).abs() / want.abs())[normal]
    assert rel.max() < 1.5e-5
    codes = q.view(torch.uint8).int() & 0x7F
    invalid = (codes == 0) | ~torch.isfinite(q.float())
    assert (got[invalid] == 0).all()
    assert torch.equal(torch.signbit(got[invalid]), torch.signbit(q.float()[invalid]))
    # below 4·FLT_MIN: an A clamped to FLT_MIN (B <= 3) decodes to at most ~3·FLT_MIN
    bound = torch.clamp(want[~normal].abs() * (1 + 1.5e-5), min=3.01 * coat.FLT_MIN)
    assert (got[~normal].abs() <= bound).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_states_of_the_previous_version_decode_within_2_5e_5(dtype):
    """A saved state is codes + scales + exponents (unchanged): decoding it with the factored
    tables differs from the previous per-code exp2 by < 2.5e-5 (relative) wherever the value is
    a normal fp32 number."""
    q, scale, k = every_code_groups(dtype, 64, seed=1)
    new = coat.dequantize_groups(q, scale, k).double()
    old = legacy_decode(q, scale, k).double()
    # the previous decode read E5M2's inf codes (never stored: the encoder saturates) as numbers
    normal = (old.abs() >= coat.FLT_MIN * 4) & torch.isfinite(q.float())
    rel = ((new - old).abs() / old.abs())[normal]
    assert rel.max() < 2.5e-5
    assert normal.float().mean() > 0.9


def test_extreme_groups_stay_finite_and_bounded():
    """amax near FLT_MAX with the smallest k (A would overflow without the clamp), and a group
    near FLT_MIN (A clamped to FLT_MIN): finite, and never above 3·FLT_MIN / above amax."""
    q = torch.arange(256, dtype=torch.uint8).view(E4M3).view(2, 128)
    for amax in (3.0e38, 1.0e-37):
        scale = torch.full((2,), amax / 448.0)
        k = torch.full((2,), coat.EXPONENT_MIN)
        got = coat.dequantize_groups(q, scale, k)
        assert torch.isfinite(got).all()
        assert (got.abs() <= amax * (1 + 1e-4) + 3 * coat.FLT_MIN).all()
    big = coat.dequantize_groups(q, torch.full((2,), 3.0e38 / 448.0), torch.ones(2))
    assert math.isclose(float(big.abs().max()), 3.0e38, rel_tol=1e-5)
