"""R27 F6 (observer parameters validated) and F7 (MSE searches its amax once per observer)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.calibration import make_observer
from hf_fp8.calibration import observers as observers_module

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("momentum", [2.0, 1.5, 1.0, -1.0, -0.1, math.nan])
def test_moving_average_refuses_a_momentum_out_of_range(momentum):
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        make_observer("moving_average", E4M3, momentum=momentum)


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.99])
def test_moving_average_accepts_a_momentum_in_range(momentum):
    obs = make_observer("moving_average", E4M3, momentum=momentum)
    obs.update(torch.tensor([1.0]))
    obs.update(torch.tensor([3.0]))
    assert float(obs.amax()) == pytest.approx(momentum * 1.0 + (1 - momentum) * 3.0)


@pytest.mark.parametrize("candidates", [1, 0, -3, 2.5])
def test_mse_refuses_too_few_candidates(candidates):
    with pytest.raises(ValueError, match="candidates must be an integer of at least 2"):
        make_observer("mse", E4M3, candidates=candidates)


def test_mse_with_two_candidates_can_pick_the_full_range():
    obs = make_observer("mse", E4M3, candidates=2)  # 0.3 * max and max
    x = torch.linspace(-1, 1, 1000)
    obs.update(x)
    assert float(obs.amax()) == pytest.approx(1.0)


def test_calibrate_refuses_a_bad_momentum_before_running(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )
    with pytest.raises(ValueError, match="momentum"):
        hf_fp8.calibrate(
            model, {"input_ids": torch.ones(1, 4, dtype=torch.long)}, "moving_average", momentum=2.0
        )


def test_mse_searches_once_per_observer(tiny_model_dir, monkeypatch):
    calls = {"n": 0}
    original = observers_module.quantize_with_scale

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(observers_module, "quantize_with_scale", counted)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )
    batch = {"input_ids": torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(2))}
    scales = hf_fp8.calibrate(model, batch, observer="mse", progress=False)
    assert calls["n"] == 50 * len(scales)  # one search (50 candidates) per layer


def test_mse_cache_follows_new_batches():
    obs = make_observer("mse", E4M3)
    obs.update(torch.linspace(-1, 1, 1000))
    first = float(obs.amax())
    assert first <= 1.0
    obs.update(torch.linspace(-20, 20, 1000))  # 20x larger: the 0.3 floor alone is 6
    assert float(obs.amax()) >= 0.3 * 20 > first
    assert float(obs.scale()) == pytest.approx(float(obs.amax()) / 448)
