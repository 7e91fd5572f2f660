"""The R8 cases (a v beside a 1e4x outlier column, a NaN and an inf gradient element) with the
C kernel built for the baseline ISA (no AVX-512: the scalar loops, vectorized by the compiler
or not): the reference's bits, as the AVX-512 build gives them (the other test_review8 files)."""

from __future__ import annotations

import pytest
import torch

from tests.bitwise import assert_states_bit_equal
from tests.optim.test_kernel_portable import baseline_kernels  # noqa: F401  (fixture)
from tests.optim.test_review8_log_inf_group import _bit_run as inf_run
from tests.optim.test_review8_nan_gradient import _bit_run as nan_run
from tests.optim.test_review8_plain_v_floor import _bit_run as outlier_run


def _same(a, b) -> None:
    (pa, oa), (pb, ob) = a, b
    ok = ~torch.isnan(pa)
    assert torch.equal(torch.isnan(pa), torch.isnan(pb))
    assert torch.equal(pa[ok].view(torch.int32), pb[ok].view(torch.int32))
    assert_states_bit_equal(oa.state[next(iter(oa.state))], ob.state[next(iter(ob.state))])


@pytest.mark.slow  # builds four libraries
def test_baseline_kernel_writes_the_reference_bits_in_the_r8_cases(baseline_kernels):  # noqa: F811
    pa, _, oa = outlier_run("reference", {"stochastic_rounding": True})
    pb, _, ob = outlier_run("cpu_kernel", {"stochastic_rounding": True})
    _same((pa, oa), (pb, ob))
    for fmt in ("plain", "log"):
        _same(
            nan_run("reference", fmt, float("nan"), 128, True),
            nan_run("cpu_kernel", fmt, float("nan"), 128, True),
        )
    _same(inf_run("reference", False, 128, 1), inf_run("cpu_kernel", False, 128, 1))
    assert baseline_kernels  # the baseline libraries did the steps
