"""hf_fp8.numerics.log_moments (the moment_format="log" codes) against float64 bounds."""

from __future__ import annotations

import torch

from hf_fp8.numerics import log_moments as lm
from tests.optim.reference import log_v_dequant_reference


def spread(groups: int, octaves: float, seed: int = 0) -> torch.Tensor:
    """Positive fp32 groups of 128 whose magnitudes span ``octaves`` octaves."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(-octaves * torch.rand(groups, 128, generator=g)) * 1e-3


def test_v_roundtrip_error_is_half_a_code_step():
    """Round to nearest: |v̂ - v| / v <= 1 / (32·k) (half a code; 16·k codes per octave, the
    relative step within an octave is at most 1 / (16·k)), for ranges of 1 to 40 octaves."""
    for octaves in (1.0, 8.0, 16.0, 40.0):
        v = spread(64, octaves)
        codes, amax, k = lm.quantize_v(v)
        v_hat = lm.dequantize_v(codes, amax, k).double()
        rel = ((v_hat - v.double()).abs() / v.double()).max(dim=1).values
        assert (rel <= 1.0 / (32.0 * k.double()) + 1e-6).all(), octaves
        assert (codes > 0).all()  # the range fills the codes: nothing flushed to zero
        # the tests' own float64 decoding of the documented format agrees up to the fp32
        # rounding of the bit offset (|offset| < 2^31: at most 128 units of 2^-23, 1.5e-5)
        ref = log_v_dequant_reference(codes, amax, k)
        assert torch.allclose(v_hat, ref, rtol=2e-5, atol=0)


def test_v_expansion_uses_the_codes():
    """k stretches a narrow group over the codes: 2 octaves get about 127 codes per octave."""
    v = spread(16, 2.0)
    codes, _, k = lm.quantize_v(v)
    assert (k >= 7.5).all()  # 254 / (16·range) with a Mitchell range <= 2
    assert int(codes.min()) <= 10 and int(codes.max()) == 255


def test_v_stochastic_rounding_is_unbiased():
    """Over many draws the mean of v̂ is v (the property that lets a β2 decay survive)."""
    v = spread(4, 6.0, seed=1)
    total = torch.zeros_like(v, dtype=torch.float64)
    draws = 100
    for i in range(draws):
        bits = lm.sr_bits(torch.tensor(0x1234567 * (i + 1) & 0xFFFFFFFF), v.shape)
        codes, amax, k = lm.quantize_v(v, bits)
        total += lm.dequantize_v(codes, amax, k).double()
    bias = (total / draws - v.double()) / v.double()
    assert bias.abs().mean() < 2e-3  # RTN's own error is ~1e-2 on average
    assert bias.abs().max() < 2e-2


def test_zero_and_subnormal_groups_store_zeros():
    v = torch.zeros(3, 128)
    v[1, 5] = 1e-40  # below FLT_MIN: counts as zero
    v[2, :] = 1e-30
    v[2, 7] = 0.0
    codes, amax, k = lm.quantize_v(v)
    assert codes[0].eq(0).all() and codes[1].eq(0).all() and float(amax[0]) == 0.0
    assert float(k[0]) == 1.0 and float(k[2]) == 1.0  # constant group
    v_hat = lm.dequantize_v(codes, amax, k)
    assert torch.equal(v_hat[0], torch.zeros(128)) and torch.equal(v_hat[1], torch.zeros(128))
    assert v_hat[2, 7] == 0 and torch.allclose(v_hat[2, :7], torch.full((7,), 1e-30))


def test_m_roundtrip_error_is_half_an_int8_step_times_its_power_of_two():
    """|m̂ - m| <= scale·2^e / 2 element-wise; 2^e follows sqrt(v̂) within a factor 2."""
    g = torch.Generator().manual_seed(2)
    v = spread(32, 12.0, seed=3)
    m = torch.randn(32, 128, generator=g) * v.sqrt()  # m / sqrt(v) of order 1
    codes_v, amax, k = lm.quantize_v(v)
    s, s_inv = lm.m_scales(codes_v, amax, k)
    assert torch.equal(s * s_inv, torch.ones_like(s))  # exact powers of two
    ratio = s.double() / lm.dequantize_v(codes_v, amax, k).double().sqrt()
    assert (ratio > 0.49).all() and (ratio <= 1.01).all()
    q, scale = lm.quantize_m(m * s_inv)
    m_hat = lm.dequantize_m(q, scale, s).double()
    err = (m_hat - m.double()).abs()
    assert (err <= 0.5 * scale.double().unsqueeze(-1) * s.double() * (1 + 1e-6)).all()
    assert q.abs().amax(dim=1).eq(127).all()  # absmax fills the int8 range


def test_m_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(4)
    m = torch.randn(8, 128, generator=g)
    total = torch.zeros_like(m, dtype=torch.float64)
    ones = torch.ones_like(m)
    draws = 100
    for i in range(draws):
        q, scale = lm.quantize_m(m, lm.sr_bits(torch.tensor(977 * i + 5), m.shape))
        total += lm.dequantize_m(q, scale, ones).double()
    step = float(m.abs().max()) / 127
    assert ((total / draws - m.double()).abs() < 0.15 * step).float().mean() > 0.95
