"""Reviewer R31 F8, F10: static FP8 layers broke around ``torch.inference_mode()``, where the
float model runs: a static input scale that is an inference tensor (set by ``calibrate`` or
``set_input_scale`` under inference_mode, or loaded by ``from_pretrained`` there) made every
later forward raise "Inference tensors do not track version counter" (the saturation counter
read ``_version``), and a clipping count started under inference_mode raised "Inplace update
to inference tensor outside InferenceMode" on a later sampled forward outside it. The
reference is the dequantized float model with the activations fake-quantized by the same
static scale, in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.saturation import SaturationCounter
from hf_fp8.numerics import fp8_max
from tests.tiny_models import TINY, model_inputs, model_output

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _static_reference(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """float64: x fake-quantized with the layer's static scale @ the dequantized weight."""
    scale = float(layer.input_scale)
    limit = fp8_max(layer.weight.dtype)
    xq = (x.double() / scale).clamp(-limit, limit).to(layer.weight.dtype).double() * scale
    out = xq @ layer.dequantize_weight(torch.float64).T
    return out if layer.bias is None else out + layer.bias.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _layer() -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_linear(nn.Linear(32, 16), Fp8Config("static", activation_scale=0.05))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_scale_set_under_inference_mode_works_in_every_mode(mode: str) -> None:
    layer = _layer()
    with torch.inference_mode():
        layer.set_input_scale(0.02)
    assert not layer.input_scale.is_inference()  # updatable outside inference mode
    x = torch.randn(4, 32)
    for _ in range(2 * SaturationCounter.sample_every + 1):  # sampled forwards included
        with MODES[mode]():
            out = layer(x)
        assert _rel(out, _static_reference(x, layer)) < 1e-5
    layer.load_state_dict(layer.state_dict())  # copy_ into it, outside inference mode


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_layer_built_under_inference_mode_runs_outside_it(mode: str) -> None:
    """What from_pretrained under inference_mode gives: every tensor an inference tensor."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    with torch.inference_mode():
        layer = Fp8Linear.from_linear(linear, Fp8Config("static", activation_scale=0.05))
        layer.input_scale = nn.Parameter(torch.full((1,), 0.05), requires_grad=False)
    assert layer.input_scale.is_inference()
    x = torch.randn(4, 32)
    for _ in range(2 * SaturationCounter.sample_every + 1):
        with MODES[mode]():
            out = layer(x)
        assert _rel(out, _static_reference(x, layer)) < 1e-5


def test_a_count_started_under_inference_mode_keeps_counting_outside(monkeypatch) -> None:
    monkeypatch.setattr(SaturationCounter, "check_every", 4)
    monkeypatch.setattr(SaturationCounter, "sample_every", 1)
    layer = _layer()
    layer.set_input_scale(1e-4)  # clips everything above 0.0448
    x = torch.randn(3, 32)
    expected = float((x.abs() > 1e-4 * 448).float().mean())
    with torch.inference_mode():
        layer(x)  # the count starts here
    with pytest.warns(RuntimeWarning, match="clipped"):
        for _ in range(3):  # sampled forwards 2-4 outside inference mode: no error, a warning
            with torch.no_grad():
                layer(x)
    assert layer.saturation_fraction() == pytest.approx(expected)
    layer(x)  # and in grad mode
    with torch.inference_mode():
        layer(x)  # and back under inference_mode


def test_a_new_inference_scale_restarts_the_count(monkeypatch) -> None:
    """Inference tensors have no version counter: a new tensor still restarts the count."""
    monkeypatch.setattr(SaturationCounter, "check_every", 100)
    monkeypatch.setattr(SaturationCounter, "sample_every", 1)
    layer = _layer()
    x = torch.randn(3, 32)
    with torch.inference_mode():
        layer.input_scale = nn.Parameter(torch.full((1,), 1e-4), requires_grad=False)
        layer(x)
        assert layer.saturation_fraction() > 0.5
        layer.input_scale = nn.Parameter(torch.full((1,), 1.0), requires_grad=False)
        layer(x)
    assert layer.saturation_fraction() == 0.0


def _static_sequential() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    fp8 = copy.deepcopy(net)
    hf_fp8.quantize_model(fp8, Fp8Config("static", activation_scale=0.05))
    return net, fp8


def test_calibrate_under_inference_mode_then_forward_outside() -> None:
    net, fp8 = _static_sequential()
    batches = [torch.randn(8, 32) for _ in range(2)]
    with torch.inference_mode():
        hf_fp8.calibrate(fp8, batches, progress=False)
    assert not any(m.input_scale.is_inference() for m in (fp8[0], fp8[2]))
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = net(x)
        for _ in range(SaturationCounter.sample_every + 1):
            got = fp8(x)
    with torch.inference_mode():
        got_inference = fp8(x)
    assert _rel(got, want) < 0.1 and _rel(got_inference, want) < 0.1
    fp8.load_state_dict(fp8.state_dict())  # the calibrated scales take a copy_ outside


def test_from_pretrained_static_under_inference_mode(tmp_path) -> None:
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).eval().save_pretrained(tmp_path)
    inputs = model_inputs("llama")
    with torch.inference_mode():
        fp8 = model_cls.from_pretrained(
            tmp_path, quantization_config=Fp8Config("static", activation_scale=0.05)
        )
        float_model = model_cls.from_pretrained(tmp_path)
    with torch.no_grad():
        want = model_output(float_model, inputs)
        for _ in range(SaturationCounter.sample_every + 1):
            got = model_output(fp8, inputs)
    with torch.inference_mode():
        got_inference = model_output(fp8, inputs)
    assert _rel(got, want) < 0.1 and _rel(got_inference, want) < 0.1


def test_from_pretrained_under_inference_mode_then_train(tmp_path) -> None:
    """R31 F11: the float model loaded under inference_mode trains afterwards; the FP8 one
    failed in its first norm layer ("Inference tensors cannot be saved for backward")."""
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).eval().save_pretrained(tmp_path)
    inputs = model_inputs("llama")
    with torch.inference_mode():
        fp8 = model_cls.from_pretrained(tmp_path, quantization_config=Fp8Config("weight_only"))
        float_model = model_cls.from_pretrained(tmp_path)
    losses = []
    for model in (float_model, fp8):
        out = model(**inputs, labels=inputs["input_ids"])
        out.loss.backward()
        losses.append(float(out.loss))
        assert model.model.embed_tokens.weight.grad is not None
        model.load_state_dict(model.state_dict())  # copy_ outside inference mode
    assert abs(losses[1] - losses[0]) < 0.05 * abs(losses[0])
