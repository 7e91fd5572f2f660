"""Reviewer R33 F5 / F6: static input scales that vLLM serves as one scale were exported
silently. vLLM keeps one input scale for a fused linear (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``: ``input_scale.max()``) and one per fused-MoE layer and projection over all its
experts (``w13_input_scale.max()``, ``w2_input_scale.max()``). Siblings given different scales,
and per-expert calibrated scales, now warn at export, naming the modules, the largest scale
vLLM keeps and the fix. The scales named are read from the model itself (its ``input_scale``
buffers), and the fused case is checked against an fp32 emulation of what vLLM computes."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.serialization import export_checkpoint
from tests.serialization.helpers import quantized
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import model_inputs

FORMATS = ("compressed-tensors", "vllm-fp8")
ATTN = "model.layers.0.self_attn"
GIVEN = {f"{ATTN}.q_proj": 0.002, f"{ATTN}.k_proj": 0.02, f"{ATTN}.v_proj": 0.02}


def _scale_warnings(model, out, fmt) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(model, out, fmt)
    return [str(w.message) for w in caught if "input scale" in str(w.message)]


@pytest.fixture(scope="module")
def given_scales(tiny_model_dir):
    config = Fp8Config(
        "static", weight_granularity="tensor", activation_scale=0.01, activation_scales=GIVEN
    )
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), quantization_config=config)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_siblings_with_different_input_scales_warn(given_scales, tmp_path, fmt):
    model = given_scales
    scales = {n: float(model.get_submodule(n).input_scale) for n in GIVEN}
    assert len(set(scales.values())) == 2  # the model holds what was given
    found = _scale_warnings(model, tmp_path / "out", fmt)
    assert len(found) == 1, found
    largest = max(scales.values())
    assert f"{ATTN}.q_proj" in found[0] and "qkv_proj" in found[0], found[0]
    assert f"{largest:g}" in found[0] and "largest" in found[0], found[0]
    assert "one scale" in found[0], found[0]  # the fix


@torch.no_grad()
def test_the_warned_difference_is_real(given_scales):
    """fp32 emulation of vLLM's fused qkv_proj on q_proj: the input quantized with the largest
    sibling scale, against hf_fp8's q_proj (its own scale)."""
    q = given_scales.get_submodule(f"{ATTN}.q_proj")
    x = torch.randn(2, 12, q.in_features, generator=torch.Generator().manual_seed(0)) * 0.3
    scale = max(float(given_scales.get_submodule(n).input_scale) for n in GIVEN)
    xq = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    want = xq @ q.dequantize_weight(torch.float32).T
    ours = q(x)
    assert float((ours - want).abs().max() / want.abs().max()) > 1e-3


@pytest.mark.parametrize("fmt", FORMATS)
def test_calibrated_siblings_share_a_scale_and_do_not_warn(tiny_model_dir, tmp_path, fmt):
    model = quantized(tiny_model_dir("llama"), "static-tensor")
    for layer in model.model.layers:
        attn = [float(getattr(layer.self_attn, p).input_scale) for p in ("q_proj", "k_proj")]
        mlp = [float(getattr(layer.mlp, p).input_scale) for p in ("gate_proj", "up_proj")]
        assert len(set(attn)) == 1 and len(set(mlp)) == 1  # they read one input
    assert _scale_warnings(model, tmp_path / "out", fmt) == []


@pytest.fixture(scope="module")
def static_moe(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen3moe")
    tiny_qwen3_moe().save_pretrained(base)
    config = Fp8Config("static", weight_granularity="tensor")
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=config)
    hf_fp8.calibrate(model, [model_inputs("llama", seed=s) for s in (1, 2, 3)], progress=False)
    return model


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_expert_input_scales_warn(static_moe, tmp_path, fmt):
    experts = static_moe.model.layers[0].mlp.experts
    down = experts.down_proj_input_scale.reshape(-1).float()
    assert down.numel() > 1 and float(down.max()) > float(down.min())  # calibrated per expert
    found = _scale_warnings(static_moe, tmp_path / "out", fmt)
    assert len(found) == 1, found
    assert "model.layers.0.mlp.experts" in found[0] and "down_proj" in found[0], found[0]
    assert f"{float(down.max()):g}" in found[0] and "largest" in found[0], found[0]
    assert "every expert" in found[0], found[0]
