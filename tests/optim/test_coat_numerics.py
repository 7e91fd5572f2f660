"""hf_fp8.numerics.coat against a plain float64 transcription of the COAT paper's math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_fp8.numerics import coat
from tests.optim.reference import FMAX, coat_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_round(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(values).float().clamp(-FMAX[dtype], FMAX[dtype]).to(dtype)


def adam_like(rows: int, seed: int = 0) -> torch.Tensor:
    """Rows of moment-like values: magnitudes spread over 1e-9..1, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** torch.empty(rows, 128).uniform_(-6, 0, generator=g)
    scale = 10 ** torch.empty(rows, 1).uniform_(-3, 0, generator=g)
    x = torch.randn(rows, 128, generator=g).sign() * mag * scale
    x[:, ::17] = 0.0
    return x


def test_fast_log2_and_exp2_accuracy():
    x = torch.logspace(-37, 37, 20001, dtype=torch.float64).float()
    err = (coat.fast_log2(x).double() - torch.log2(x.double())).abs().max()
    assert err < 1e-5  # polynomial 2.5e-6 + fp32 rounding of exponent + fraction
    y = torch.linspace(-125.9, 120.0, 20001)
    rel = (coat.fast_exp2(y).double() / torch.exp2(y.double()) - 1).abs().max()
    assert rel < 5e-6
    assert torch.equal(
        coat.fast_exp2(torch.tensor([0.0, 1.0, -3.0])), torch.tensor([1.0, 2.0, 0.125])
    )


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_expansion_matches_paper_formula(dtype):
    x = adam_like(512)
    q, scale, k = coat.quantize_groups(x, dtype)
    ref_values, ref_k = coat_reference(x.numpy(), FMAX[dtype])
    assert np.mean(k.numpy() == ref_k) > 0.99  # floor() may flip on ~1e-6 log2 differences
    same_k = torch.from_numpy(k.numpy() == ref_k)
    ref_q = fp8_round(ref_values, dtype)
    codes, ref_codes = q.view(torch.uint8).int(), ref_q.view(torch.uint8).int()
    agree = (codes == ref_codes)[same_k]
    assert agree.float().mean() > 0.995
    assert ((codes - ref_codes).abs()[same_k] <= 1).all()  # at most one fp8 step apart
    assert torch.equal(scale, x.abs().amax(-1) / FMAX[dtype])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_roundtrip_relative_error_bound(dtype):
    x = adam_like(256, seed=1)
    q, scale, k = coat.quantize_groups(x, dtype)
    x_hat = coat.dequantize_groups(q, scale, k)
    fmax, ke = FMAX[dtype], k.double().unsqueeze(-1)
    half_ulp = 2.0 ** -(4 if dtype == E4M3 else 3)  # relative, normal fp8 values
    half_sub = 2.0 ** -(10 if dtype == E4M3 else 17)  # absolute, subnormal fp8 values
    amax = x.double().abs().amax(-1, keepdim=True)
    code = fmax * (x.double().abs() / amax) ** ke  # exact, before rounding to fp8
    representable = code >= 2 * half_sub
    err_code = torch.maximum(torch.full_like(code, half_ulp), half_sub / code)
    # a relative code error e becomes at most max((1+e)^(1/k) - 1, 1 - (1-e)^(1/k))
    bound = torch.maximum((1 + err_code) ** (1 / ke) - 1, 1 - (1 - err_code) ** (1 / ke)) + 1e-5
    rel = (x_hat.double() - x.double()).abs() / x.double().abs()
    assert (rel[representable] <= bound[representable]).all()
    assert representable.float().mean() > 0.9
    zeros = x == 0
    assert torch.equal(x_hat[zeros], torch.zeros_like(x_hat[zeros]))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_plain_absmax_matches_reference(dtype):
    x = adam_like(256, seed=2)
    q, scale, k = coat.quantize_groups(x, dtype, dynamic_range_expansion=False)
    assert k is None
    amax = x.double().abs().amax(-1, keepdim=True)
    ref = fp8_round((x.double() / (amax / FMAX[dtype])).numpy(), dtype)
    agree = q.view(torch.uint8) == ref.view(torch.uint8)
    assert agree.float().mean() > 0.999
    x_hat = coat.dequantize_groups(q, scale)
    assert torch.allclose(x_hat, ref.float() * scale.unsqueeze(-1))


def test_expansion_beats_plain_on_second_moments():
    """v-like values (squares of heavy-tailed gradients) lose far less with COAT."""
    g = torch.Generator().manual_seed(3)
    grads = torch.randn(64, 4096, generator=g) * 10 ** torch.empty(64, 4096).uniform_(
        -3, 0, generator=g
    )
    v = (grads**2).view(-1, 128)
    errs = {}
    for expand in (False, True):
        q, s, k = coat.quantize_groups(v, E4M3, dynamic_range_expansion=expand)
        v_hat = coat.dequantize_groups(q, s, k)
        # error of 1/sqrt(v), what Adam uses
        errs[expand] = (
            ((v_hat.sqrt() + 1e-8).reciprocal() / (v.sqrt() + 1e-8).reciprocal() - 1).abs().mean()
        )
    assert errs[True] < 0.5 * errs[False]


def test_traps_zero_tiny_constant_and_huge_range():
    x = torch.zeros(6, 128)
    x[1] = 3.0  # constant magnitude: k = 1, exact
    x[1, ::2] = -3.0
    x[2, 5] = 1e-39  # only an fp32 denormal: treated as zero
    x[3] = torch.logspace(-20, -25, 128)  # amax·amin underflows in fp32 (the sqrt(M·μ) trap)
    x[4] = torch.logspace(-37, 37, 128)  # range beyond fp8: k clamped, 1/k finite
    x[5, 0] = 3e38  # huge value next to zeros: saturates instead of inf/NaN
    for expand in (True, False):
        q, s, k = coat.quantize_groups(x, E4M3, dynamic_range_expansion=expand)
        x_hat = coat.dequantize_groups(q, s, k)
        assert torch.isfinite(x_hat).all()
        assert torch.equal(x_hat[0], torch.zeros(128)) and torch.equal(x_hat[2], torch.zeros(128))
        assert torch.allclose(x_hat[1], x[1], rtol=1e-5, atol=0)
        assert torch.allclose(x_hat[5], x[5], rtol=0.07)
        if expand:
            assert k[0] == 1 and k[1] == 1 and k[4] == coat.EXPONENT_MIN
            assert torch.allclose(x_hat[3], x[3], rtol=0.02)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32),
        min_size=128,
        max_size=128,
    ),
    st.booleans(),
)
def test_property_finite_signs_and_largest_element(values, expand):
    x = torch.tensor(values, dtype=torch.float32).view(1, 128)
    q, s, k = coat.quantize_groups(x, E4M3, dynamic_range_expansion=expand)
    x_hat = coat.dequantize_groups(q, s, k)
    assert torch.isfinite(x_hat).all()
    assert ((x_hat == 0) | (x_hat.sign() == x.sign())).all()
    i = x.abs().argmax()
    tiny = 448 * 2.0**-149  # scale = amax / 448 may be an fp32 denormal
    if x.abs().max() >= coat.FLT_MIN:  # the largest element maps onto ±448 and back
        # log2-domain rounding is amplified by 1/k (k ≥ 1/16) in the expansion mode
        rtol = 1e-5 if k is None else 1e-5 + 3e-6 / float(k)
        assert torch.allclose(x_hat.view(-1)[i], x.view(-1)[i], rtol=rtol, atol=tiny)
    assert (x_hat.abs() <= x.abs().max() * (1 + 1e-4) + tiny).all()
