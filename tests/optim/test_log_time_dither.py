"""Issue 15: the log format's stochastic-rounding thresholds are low-discrepancy in time
(``log_moments.time_key``), so its stored second moment follows float64 AdamW's more closely
than with independent draws every step."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.numerics import coat
from hf_fp8.numerics import log_moments as lm
from hf_fp8.optim import AdamWFp8


@pytest.mark.parametrize("step", [0, 1, 2, 977, 2**33 + 5])
def test_time_key_advances_each_element_by_the_time_stride(step: int) -> None:
    base = coat.stream_key(7, 0, 3, 1)
    n = 300
    bits = lm.sr_bits(torch.tensor(lm.time_key(base, step)), torch.Size([n]))
    want = [((base + i) * lm.WEYL + step * lm.TIME_STRIDE) % 2**32 for i in range(n)]
    assert bits.tolist() == want


def test_one_elements_thresholds_are_evenly_spread_over_steps() -> None:
    base = coat.stream_key(0, 0, 5, 1)
    u = torch.cat(
        [
            lm.uniform(lm.sr_bits(torch.tensor(lm.time_key(base, t)), torch.Size([1])))
            for t in range(1000)
        ]
    )
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    # independent draws: 100 +- 9.5 per bin (one standard deviation)
    assert (counts - 100).abs().max() <= 3


def v_error(steps: int) -> float:
    """Relative error of the stored v against float64 AdamW's after ``steps`` steps of
    stationary noisy gradients with row scales over three decades."""
    p = torch.nn.Parameter(torch.zeros(64, 512))
    opt = AdamWFp8(
        [p], lr=0.0, weight_decay=0.0, moment_format="log", stochastic_rounding="exp_avg_sq"
    )
    scale = 10 ** torch.empty(64, 1).uniform_(-3, 0, generator=torch.Generator().manual_seed(1))
    exact = torch.zeros(64, 512, dtype=torch.float64)
    for step in range(steps):
        g = torch.randn(64, 512, generator=torch.Generator().manual_seed(step)) * scale
        exact = exact * 0.999 + 0.001 * g.double() ** 2
        p.grad = g
        opt.step()
    _, v = opt.moments(p)
    return float((v.double() - exact).norm() / exact.norm())


def test_low_discrepancy_thresholds_track_v_better_than_independent_draws(monkeypatch) -> None:
    low_discrepancy = v_error(400)
    # the same optimizer with a fresh hash per step (independent thresholds)
    monkeypatch.setattr(lm, "time_key", lambda base, step: coat.stream_key(base, step, 0, 0))
    independent = v_error(400)
    print(f"v error: time low-discrepancy {low_discrepancy:.4f}, independent {independent:.4f}")
    assert low_discrepancy < 0.8 * independent
