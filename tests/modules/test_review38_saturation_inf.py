"""R38 F6: NaN / inf activations are not "clipped" by a static scale.

A static layer's saturation counter counted ``|x| > input_scale * fp8_max`` and so took an
all-inf token for clipping: "clipped 25 % ... input_scale is too small ... re-calibrate",
advice that cannot help (the quantization makes inf a NaN code at any scale, the output row
is NaN). Now only finite values over the limit count as clipped; non-finite inputs are
counted apart and named in their own warning. References: counts made here by hand from the
input, never the counter.
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


def _layer() -> Fp8Linear:
    lin = torch.nn.Linear(64, 8)
    cfg = hf_fp8.Fp8Config("static", activation_scale=1.0)  # clips |x| > 448
    return Fp8Linear.from_linear(lin, cfg, module_name="model.layers.0.mlp.up_proj")


def _run(layer: Fp8Linear, x: torch.Tensor) -> list[str]:
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        layer(x)
    return [str(w.message) for w in caught if "hf_fp8" in str(w.message)]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_token_is_not_reported_as_clipping(bad) -> None:
    layer = _layer()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[0, :] = bad  # nothing finite comes near 448
    messages = _run(layer, x)
    assert layer.saturation_fraction() == 0.0
    assert not any("clipped" in m or "re-calibrate" in m for m in messages), messages
    assert len(messages) == 1, messages
    assert "non-finite" in messages[0] and "model.layers.0.mlp.up_proj" in messages[0]
    assert "64 of 256" in messages[0], messages[0]


def test_finite_values_over_the_limit_still_count_next_to_inf() -> None:
    layer = _layer()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    x[0, :] = float("inf")
    x[1, :8] = 1000.0  # clipped at 448
    x[2, :3] = -500.0
    expected = 11 / x.numel()  # by hand: the finite values over 448
    messages = _run(layer, x)
    assert layer.saturation_fraction() == pytest.approx(expected)
    clipping = [m for m in messages if "clipped" in m]
    assert len(clipping) == 1 and f"{expected:.2%}" in clipping[0], messages
    assert sum("non-finite" in m for m in messages) == 1, messages
