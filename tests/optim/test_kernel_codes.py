"""Every stored fp8 code (subnormals, -0, the NaN code) decodes in the C kernel as in the
reference step: the kernel's table decode of E4M3 codes with COAT expansion (and the
per-element decode of the other variants) gives the reference's bits."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.utils import native
from tests.bitwise import assert_bit_equal, assert_states_bit_equal

needs_kernel = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


def step_with_all_codes(
    implementation: str, fp8_format: str, k_m: float, k_v: float, group_size: int, **options
):
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(6, 256, generator=g) * 0.1)
    opt = AdamWFp8(
        [p],
        lr=1e-2,
        min_quantize_numel=1000,
        fp8_format=fp8_format,
        implementation=implementation,
        group_size=group_size,
        **options,
    )
    p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()  # creates the state
    st = opt.state[p]
    codes = torch.arange(256, dtype=torch.int32).roll(37).repeat(6)  # every code, unaligned
    st["exp_avg_fp8"].view(torch.uint8).view(-1).copy_(codes.to(torch.uint8))
    # v: non-negative codes only, NaN code included (it decodes to a zero magnitude)
    st["exp_avg_sq_fp8"].view(torch.uint8).view(-1).copy_((codes & 0x7F).to(torch.uint8))
    st["exp_avg_exponent"].fill_(k_m)
    st["exp_avg_sq_exponent"].fill_(k_v)
    st["exp_avg_scale"].copy_(
        torch.logspace(-6, 0, st["exp_avg_scale"].numel()).view_as(st["exp_avg_scale"])
    )
    st["exp_avg_sq_scale"].copy_(
        torch.logspace(-30, -2, st["exp_avg_sq_scale"].numel()).view_as(st["exp_avg_sq_scale"])
    )
    p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()
    return p, opt


@needs_kernel
@pytest.mark.parametrize("fp8_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize(("k_m", "k_v"), [(1.0, 1.0), (2.5, 0.0625), (0.0625, 7.0)])
@pytest.mark.parametrize("options", [{}, {"stochastic_rounding": False}])
@pytest.mark.parametrize("group_size", [128, 8])
def test_every_code_decodes_as_in_the_reference(fp8_format, k_m, k_v, options, group_size):
    """group_size=8 (a divisor of the row: no padding codes, which must stay zero): the AVX2
    build's 8-code decode (vpermps) instead of its 16-code one; the scalar loop of AVX-512."""
    options = {"moment_format": "fp8", **options}
    pr, orf = step_with_all_codes("reference", fp8_format, k_m, k_v, group_size, **options)
    pk, ok = step_with_all_codes("cpu_kernel", fp8_format, k_m, k_v, group_size, **options)
    assert_bit_equal(pr, pk, "param")
    assert_states_bit_equal(orf.state[pr], ok.state[pk])
