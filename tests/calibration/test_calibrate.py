"""calibrate(): static scales from data, each observer, mode restored, saved and reloaded."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.calibration import make_observer
from tests.tiny_models import model_inputs

BATCHES = [model_inputs("llama", seed=s) for s in range(4)]


def _static(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )


def _reference_input_amax(tiny_model_dir) -> dict[str, float]:
    """max |x| seen by each linear of the *unquantized* model (the calibration forward runs
    activations in high precision, so the inputs are those of the original model up to the
    FP8 weights; compare with a tolerance)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    seen: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda _m, args, n=name: seen.__setitem__(
                n, max(seen.get(n, 0.0), float(args[0].abs().max()))
            )
        )
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    ]
    with torch.no_grad():
        for batch in BATCHES:
            model(**batch)
    for h in hooks:
        h.remove()
    return seen


def test_minmax_scales_match_reference_amax(tiny_model_dir):
    model = _static(tiny_model_dir)
    scales = hf_fp8.calibrate(model, BATCHES, observer="minmax", progress=False)
    reference = _reference_input_amax(tiny_model_dir)
    assert scales.keys() == reference.keys()
    for name, amax in reference.items():
        assert scales[name] == pytest.approx(amax / 448, rel=0.05), name
        assert float(model.get_submodule(name).input_scale) == scales[name]


def test_observers_order_and_outputs(tiny_model_dir):
    results = {}
    for observer in ("minmax", "moving_average", "percentile", "mse"):
        model = _static(tiny_model_dir)
        results[observer] = hf_fp8.calibrate(model, BATCHES, observer=observer, progress=False)
        logits = model(**BATCHES[0]).logits
        assert torch.isfinite(logits).all()
    for name, top in results["minmax"].items():
        # no observer exceeds the absolute maximum; clipping observers stay below it
        assert results["moving_average"][name] <= top * (1 + 1e-6)
        assert results["percentile"][name] <= top * (1 + 1e-6)
        assert results["mse"][name] <= top * (1 + 1e-6)


def test_mse_observer_minimises_error_on_heavy_tails():
    torch.manual_seed(0)
    x = torch.distributions.StudentT(2.0).sample((20000,))
    dtype = torch.float8_e4m3fn

    def error(scale):
        q = (x / scale).clamp(-448, 448).to(dtype).float() * scale
        return float((q - x).pow(2).mean())

    minmax, mse = make_observer("minmax", dtype), make_observer("mse", dtype)
    for obs in (minmax, mse):
        obs.update(x)
    assert error(mse.scale()) <= error(minmax.scale())
    assert float(minmax.scale()) == pytest.approx(float(x.abs().max()) / 448)


def test_progress_bar_and_mode_restored(tiny_model_dir, capsys):
    model = _static(tiny_model_dir)
    model.train()
    hf_fp8.calibrate(model, BATCHES, progress=True)
    assert model.training
    assert "calibrating" in capsys.readouterr().err
    model.eval()
    hf_fp8.calibrate(model, iter(BATCHES), progress=False)  # a generator works too
    assert not model.training
    assert all(m.activation_scheme == "static" for m in model.modules() if isinstance(m, Fp8Linear))


def test_calibrated_scales_are_saved_and_reloaded(tiny_model_dir, tmp_path):
    model = _static(tiny_model_dir)
    hf_fp8.calibrate(model, BATCHES, observer="percentile", progress=False)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            assert torch.equal(reloaded.get_submodule(name).input_scale, m.input_scale)
    assert torch.equal(reloaded(**BATCHES[0]).logits, model(**BATCHES[0]).logits)


def test_errors(tiny_model_dir):
    dynamic = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )
    with pytest.raises(ValueError, match="Fp8Config\\('static'\\)"):
        hf_fp8.calibrate(dynamic, BATCHES)
    with pytest.raises(ValueError, match="minmax"):
        hf_fp8.calibrate(_static(tiny_model_dir), BATCHES, observer="histogram")
    with pytest.raises(RuntimeError, match="saw no input"):
        hf_fp8.calibrate(_static(tiny_model_dir), [], progress=False)
