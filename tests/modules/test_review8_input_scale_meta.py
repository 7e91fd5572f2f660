"""Reviewer R7 finding 1: ``Fp8Linear.set_input_scale`` moved a real value to the device of
the weight; on an offloaded layer (weight on meta) that dropped the value silently. It now
raises, naming the layer; a meta layer still takes a meta scale (built before loading)."""

from __future__ import annotations

import pytest
import torch

from hf_fp8 import Fp8Linear


def _static(device: str) -> Fp8Linear:
    return Fp8Linear(16, 8, activation_scheme="static", device=device)


def test_real_scale_on_a_meta_weight_is_refused():
    layer = _static("meta")
    layer.__dict__["fp8_name"] = "model.layers.1.mlp.down_proj"
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj.*meta"):
        layer.set_input_scale(0.25)
    assert layer.input_scale is None  # nothing half-set


def test_meta_scale_on_a_meta_layer_is_kept_and_real_layers_take_values():
    layer = _static("meta")
    layer.set_input_scale(torch.empty(1, device="meta"))
    assert layer.input_scale.is_meta
    with torch.device("meta"):
        built = Fp8Linear(16, 8, activation_scheme="static", input_scale=0.5)
    assert built.input_scale.is_meta  # built on meta (from_pretrained), filled by the load
    deferred = Fp8Linear(16, 8, activation_scheme="static", device="meta", input_scale=0.5)
    assert deferred.input_scale.is_meta  # init_empty_weights / FSDP2: to_empty, then a load
    with pytest.raises(ValueError, match="positive finite"):
        Fp8Linear(16, 8, activation_scheme="static", device="meta", input_scale=-1.0)
    real = _static("cpu")
    real.set_input_scale(0.25)
    assert float(real.input_scale) == 0.25 and real.input_scale.device.type == "cpu"


def test_experts_refuse_a_real_scale_on_meta_weights_and_build_on_meta():
    from hf_fp8 import Fp8Config
    from hf_fp8.modules import Fp8Experts
    from tests.tiny_models import tiny_mixtral

    torch.manual_seed(0)
    source = tiny_mixtral().model.layers[0].mlp.experts
    config = Fp8Config("static", activation_scale=0.05)
    built = Fp8Experts.empty_like(source, config, module_name="e", device="meta")
    assert built.down_proj_input_scale.is_meta  # the quantizer's swap still builds
    built.__dict__["fp8_name"] = "model.layers.1.mlp.experts"
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: down_proj.*meta"):
        built.set_input_scale("down_proj", 0.25)
    built.set_input_scale("down_proj", torch.empty(built.num_experts, device="meta"))
