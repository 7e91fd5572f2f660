"""Reviewer R31 P21: ``model.to(torch.float8_e4m3fn)`` made FP8 the compute dtype of every FP8
layer, whose forward then blamed the input's dtype. Refused with a clear error before the
layer changes (a float model cast this way cannot run either: no fp8 matmul)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8)
def test_casting_an_fp8_linear_to_fp8_is_refused_and_it_still_runs(dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    layer = Fp8Linear.from_linear(linear, Fp8Config("dynamic"), module_name="blocks.0.fc")
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = linear(x)
    with pytest.raises(TypeError, match=r"blocks\.0\.fc: casting the model to float8.*bfloat16"):
        layer.to(dtype)
    assert layer.compute_dtype == torch.float32 and layer.bias.dtype == torch.float32
    with torch.no_grad():
        got = layer(x)
    assert float((got - want).norm() / want.norm()) < 0.05


def test_a_model_cast_to_fp8_names_the_first_fp8_layer() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    hf_fp8.quantize_model(model, Fp8Config("weight_only"))
    with pytest.raises(TypeError, match="casting the model to float8_e4m3fn is not supported"):
        model.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="casting the model to float8_e5m2"):
        model.type(torch.float8_e5m2)


def test_high_precision_casts_still_change_the_compute_dtype() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    layer = Fp8Linear.from_linear(copy.deepcopy(linear), Fp8Config("weight_only"))
    layer.to(torch.float64)
    assert layer.compute_dtype == torch.float64 and layer.weight.dtype == torch.float8_e4m3fn
    layer.half()
    assert layer.compute_dtype == torch.float16 and layer.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", FP8)
def test_casting_fp8_experts_to_fp8_is_refused(dtype) -> None:
    torch.manual_seed(0)
    source = Qwen3MoeExperts(
        tf.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4)
    )
    for p in source.parameters():  # the experts class leaves its weights uninitialized
        nn.init.normal_(p, std=0.1)
    experts = Fp8Experts.from_experts(source, Fp8Config("weight_only"))
    with pytest.raises(TypeError, match="casting the model to float8"):
        experts.to(dtype)
    assert experts.compute_dtype == torch.float32
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn


def test_a_static_layer_without_a_scale_names_itself_and_activation_scales() -> None:
    """R31 F5: the forward error named activation_scale only."""
    layer = Fp8Linear.from_linear(nn.Linear(16, 8), Fp8Config("static"), module_name="fc1")
    with pytest.raises(RuntimeError, match=r"fc1 has no input_scale.*activation_scales=\{'fc1'"):
        layer(torch.randn(2, 16))
