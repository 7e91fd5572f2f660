"""Each observer against an independently computed reference (python / numpy, not hf_fp8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_fp8.calibration import make_observer

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (OCP FP8 spec)


def _batches(seed: int = 0, n: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # batch maxima differ a lot, so every update rule gives a distinct answer
    out = [torch.randn(4, 16, generator=gen) * (1 + 3 * i) for i in range(n)]
    out[-1][2, 3] = -(float(out[-1].abs().max()) + 1.0)  # the largest magnitude is negative
    return out


def _abs_max(x: torch.Tensor) -> float:
    return max(abs(v) for v in x.reshape(-1).tolist())


def test_minmax_is_the_largest_magnitude_over_batches():
    obs = make_observer("minmax", E4M3)
    for x in _batches():
        obs.update(x)
    expected = max(_abs_max(x) for x in _batches())
    assert float(obs.scale()) == pytest.approx(expected / FP8_MAX, rel=1e-6)


@pytest.mark.parametrize("momentum", [0.9, 0.6, 0.25])
def test_moving_average_update_rule_exactly(momentum):
    # amax_0 = first batch max; amax_t = momentum * amax_{t-1} + (1 - momentum) * batch max
    obs = make_observer("moving_average", E4M3, momentum=momentum)
    expected = None
    for x in _batches():
        obs.update(x)
        top = _abs_max(x)
        expected = top if expected is None else momentum * expected + (1 - momentum) * top
        assert float(obs.amax()) == pytest.approx(expected, rel=1e-6)
    assert float(obs.scale()) == pytest.approx(expected / FP8_MAX, rel=1e-6)
    # a swapped momentum gives another number: the assertions above can tell them apart
    swapped = None
    for x in _batches():
        top = _abs_max(x)
        swapped = top if swapped is None else (1 - momentum) * swapped + momentum * top
    assert abs(swapped - expected) > 1e-3 * expected


def test_moving_average_default_momentum_weights_the_old_value():
    obs = make_observer("moving_average", E4M3)
    obs.update(torch.tensor([10.0]))
    obs.update(torch.tensor([0.0]))
    assert float(obs.amax()) == pytest.approx(9.0)  # 0.9 * 10 + 0.1 * 0


@pytest.mark.parametrize("percentile", [50.0, 99.0, 100.0])
def test_percentile_is_the_mean_of_per_batch_percentiles(percentile):
    obs = make_observer("percentile", E4M3, percentile=percentile)
    for x in _batches():
        obs.update(x)
    per_batch = [np.percentile(np.abs(x.numpy()), percentile) for x in _batches()]
    assert float(obs.amax()) == pytest.approx(float(np.mean(per_batch)), rel=1e-5)


def _fake_quant_error(x: torch.Tensor, amax: float) -> float:
    # torch's own saturating cast to e4m3, not hf_fp8's numerics
    scale = amax / FP8_MAX
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * scale
    return float((q - x).pow(2).mean())


def test_mse_observer_picks_the_best_documented_clipping_point():
    # documented rule: among amax = f * max|x| for 50 f evenly in [0.3, 1], the one with
    # the least fake-quantization MSE (on samples up to 2**18 values: all of these)
    torch.manual_seed(0)
    x = torch.distributions.StudentT(1.5).sample((20000,))
    obs, minmax = make_observer("mse", E4M3), make_observer("minmax", E4M3)
    obs.update(x)
    minmax.update(x)
    top = float(x.abs().max())
    errors = {f: _fake_quant_error(x, top * f) for f in np.linspace(0.3, 1.0, 50)}
    best = min(errors.values())
    assert max(errors.values()) > best * 1.01  # the grid matters for this data
    chosen = _fake_quant_error(x, float(obs.amax()))
    assert chosen <= best * (1 + 1e-4)  # float noise between two fake-quant codes
    grid = np.linspace(0.3, 1.0, 50)
    assert np.abs(grid - float(obs.amax()) / top).min() < 1e-6  # a documented candidate
    assert float(minmax.scale()) == pytest.approx(top / FP8_MAX)


@pytest.mark.parametrize("name", ["minmax", "moving_average", "percentile", "mse"])
def test_nonfinite_values_are_ignored_and_counted(name):
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    bad = x.clone()
    bad[0, 0] = float("inf")
    bad[1, 1] = float("nan")
    clean, dirty = make_observer(name, E4M3), make_observer(name, E4M3)
    clean.update(x[torch.isfinite(bad)])
    dirty.update(bad)
    assert dirty.nonfinite == 2 and clean.nonfinite == 0
    assert torch.equal(dirty.amax(), clean.amax())


@pytest.mark.parametrize("name", ["minmax", "moving_average", "percentile", "mse"])
def test_empty_and_all_zero_inputs_carry_no_information(name):
    obs = make_observer(name, E4M3)
    obs.update(torch.empty(0, 8))  # e.g. an expert that got no token
    assert obs.batches == 0 and not obs.has_information()
    obs.update(torch.zeros(3, 8))
    assert obs.batches == 1 and not obs.has_information()
    obs.update(torch.full((3, 8), 2.0))
    assert obs.has_information()
