"""R43 F1: after its clipping warning a static layer stops counting (as before this session).

ec255b1 made the counter's early exit wait for both warnings (clipping and non-finite), so a
layer that warned about clipping and never saw a NaN kept reading every sampled activation,
with a host sync every ``check_every`` sampled calls, for good. Reference: the number of
sampled calls before and after the warning, counted from the counter's own call counter and
from the forwards run here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_fp8
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.modules.saturation import SaturationCounter


@pytest.fixture(autouse=True)
def every_call(monkeypatch) -> None:
    monkeypatch.setattr(SaturationCounter, "sample_every", 1)
    monkeypatch.setattr(SaturationCounter, "check_every", 1)


def test_counting_stops_after_the_clipping_warning() -> None:
    layer = Fp8Linear.from_linear(
        torch.nn.Linear(64, 8), hf_fp8.Fp8Config("static", activation_scale=1.0), module_name="l"
    )
    x = torch.full((4, 64), 1000.0)  # every value clipped at 448
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        layer(x)
        counter = next(v for v in vars(layer).values() if isinstance(v, SaturationCounter))
        calls_at_warning = counter.calls
        for _ in range(20):
            layer(x)
    clipping = [w for w in caught if "clipped" in str(w.message)]
    assert len(clipping) == 1, [str(w.message) for w in caught]
    assert calls_at_warning == 1
    assert counter.calls == calls_at_warning, counter.calls  # no counting after the warning


def test_a_non_finite_warning_still_comes_before_any_clipping() -> None:
    layer = Fp8Linear.from_linear(
        torch.nn.Linear(64, 8), hf_fp8.Fp8Config("static", activation_scale=1.0), module_name="l"
    )
    x = torch.randn(4, 64)
    x[0] = float("nan")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        layer(x)
    messages = [str(w.message) for w in caught if "hf_fp8" in str(w.message)]
    assert len(messages) == 1 and "non-finite" in messages[0], messages
