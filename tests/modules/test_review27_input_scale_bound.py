"""A static input scale above the load-time bound was accepted by ``set_input_scale`` (and so
by calibration): the model saved, and its reload refused the scale as corrupt (reviewer R27 F9:
a 1e20 norm weight gave q_proj 7.81e17 > 4.12e16). Every setter now refuses what the loader
would refuse, naming the layer: such an activation is beyond FP8's reach at any scale the
loader accepts (``scale * fp8_max`` must stay finite in the compute dtype and ≤ 2**64)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import (
    model_inputs,
    tiny_model_dir,  # noqa: F401 (the fixture)
)

Q = "model.layers.0.self_attn.q_proj"
E4M3_MAX = 448.0
BOUND_F32 = 2.0**64 / E4M3_MAX  # the loader's limit with float32 / bfloat16 compute
BOUND_F16 = 65504.0 / E4M3_MAX  # float16: past it the dequantized activation is inf


def _static(tiny_model_dir, **kw):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", **kw)
    )


def test_set_input_scale_above_the_bound_is_refused_naming_the_layer(tiny_model_dir):  # noqa: F811
    model = _static(tiny_model_dir, activation_scale=0.05)
    layer = model.get_submodule(Q)
    with pytest.raises(ValueError, match="high precision") as err:
        layer.set_input_scale(BOUND_F32 * 1.01)
    assert Q in str(err.value)
    assert float(layer.input_scale) == pytest.approx(0.05)  # unchanged


def test_largest_accepted_scale_round_trips(tiny_model_dir, tmp_path):  # noqa: F811
    model = _static(tiny_model_dir, activation_scale=0.05)
    model.get_submodule(Q).set_input_scale(BOUND_F32 * 0.99)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.get_submodule(Q).input_scale, model.get_submodule(Q).input_scale)


def test_calibration_of_a_huge_activation_is_refused_not_saved(tiny_model_dir):  # noqa: F811
    """The reviewer's case: a 1e20 norm weight before q_proj."""
    model = _static(tiny_model_dir)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.fill_(1e20)
    with pytest.raises(ValueError, match="exceeds") as err:
        hf_fp8.calibrate(model, [model_inputs("llama")["input_ids"]])
    assert "self_attn" in str(err.value)


def test_float16_layer_uses_the_float16_bound():
    layer = Fp8Linear(32, 16, dtype=torch.float16, activation_scheme="static")
    layer.set_input_scale(BOUND_F16 * 0.99)
    with pytest.raises(ValueError, match="exceeds"):
        layer.set_input_scale(BOUND_F16 * 1.01)


def test_constructor_refuses_a_scale_above_the_bound():
    with pytest.raises(ValueError, match="exceeds"):
        Fp8Linear(32, 16, activation_scheme="static", input_scale=BOUND_F32 * 2)


def test_experts_setter_refuses_one_expert_above_the_bound():
    model = hf_fp8.quantize_model(
        tiny_qwen3_moe(), Fp8Config("static", activation_scale=0.05), skip=["lm_head"]
    )
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8Experts)
    values = torch.full((experts.num_experts,), 0.05)
    values[1] = BOUND_F32 * 1.5
    with pytest.raises(ValueError, match="exceeds") as err:
        experts.set_input_scale("down_proj", values)
    assert "down_proj" in str(err.value)
    assert torch.equal(experts.down_proj_input_scale, torch.full((experts.num_experts,), 0.05))


def test_config_refuses_a_scale_above_any_bound():
    with pytest.raises(ValueError, match="exceeds"):
        Fp8Config("static", activation_scale=1e18)
    with pytest.raises(ValueError, match="exceeds"):
        Fp8Config("static", activation_scales={Q: 1e18})
