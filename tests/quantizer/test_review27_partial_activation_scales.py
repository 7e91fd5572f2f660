"""A static model whose config gives scales to some layers only (``activation_scales`` without a
fallback ``activation_scale``) saves exactly those ``input_scale`` tensors: the other layers
have none yet (calibration would set them). Reloading it was refused as a calibrated
checkpoint that lost 13 tensors (reviewer R27 F4), although ``config.json`` names exactly the
scales stored. It now reloads as saved; a checkpoint that truly lost scales is still refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import model_inputs

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def _scales(model) -> dict[str, torch.Tensor | None]:
    """Every static input scale of ``model``, by tensor name (``None``: not set)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            out[f"{name}.input_scale"] = m.input_scale
        elif isinstance(m, Fp8Experts):
            for p in m.layout.projections:
                out[f"{name}.{p}_input_scale"] = getattr(m, f"{p}_input_scale")
    return {k: None if v is None else v.detach().clone() for k, v in out.items()}


def _assert_same_scales(reloaded, saved) -> None:
    a, b = _scales(reloaded), _scales(saved)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] is None) == (b[key] is None), key
        if a[key] is not None:
            assert torch.equal(a[key], b[key]), key


def _fill_unset(model, value: float) -> None:
    """Give every layer without a scale the same ``value`` (to run both models)."""
    for m in model.modules():
        if isinstance(m, Fp8Linear) and m.input_scale is None:
            m.set_input_scale(value)
        elif isinstance(m, Fp8Experts):
            for p in m.layout.projections:
                if getattr(m, f"{p}_input_scale") is None:
                    m.set_input_scale(p, value)


def test_llama_with_scales_for_some_layers_reloads_as_saved(tiny_model_dir, tmp_path):
    config = Fp8Config("static", activation_scales={Q: 0.5})
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    model.save_pretrained(tmp_path)
    stored = sorted(k for k in load_file(tmp_path / "model.safetensors") if "input_scale" in k)
    assert stored == [f"{Q}.input_scale"]  # only the scale the config gave
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_scales(reloaded, model)
    assert float(reloaded.get_submodule(Q).input_scale) == 0.5
    _fill_unset(model, 0.03)
    _fill_unset(reloaded, 0.03)
    inputs = model_inputs("llama")
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)


def test_llama_with_fallback_and_one_key_reloads_as_saved(tiny_model_dir, tmp_path):
    config = Fp8Config("static", activation_scale=0.05, activation_scales={Q: 0.5})
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_scales(reloaded, model)
    inputs = model_inputs("llama")
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)


def test_moe_with_one_experts_key_reloads_as_saved(tmp_path):
    config = Fp8Config("static", activation_scales={DOWN: 0.001})
    model = hf_fp8.quantize_model(tiny_qwen3_moe(), config, skip=["lm_head"])
    model.save_pretrained(tmp_path)
    stored = sorted(k for k in load_file(tmp_path / "model.safetensors") if "input_scale" in k)
    assert stored == [f"{DOWN}_input_scale"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_scales(reloaded, model)
    _fill_unset(model, 0.02)
    _fill_unset(reloaded, 0.02)
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (2, 7))}
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)


def _only_given_left(folder: Path) -> None:
    """Drop every input_scale but the one the config names (as a lossy copy would)."""
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k in tensors if k.endswith("input_scale") and k != f"{Q}.input_scale"]:
        del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_calibrated_checkpoint_that_lost_scales_is_still_refused(tiny_model_dir, tmp_path):
    """Calibrated (every layer, q_proj too, overwrote the given 0.5), then every scale but
    q_proj's lost: the names alone look like the uncalibrated save, the value does not."""
    config = Fp8Config("static", activation_scales={Q: 0.5})
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    hf_fp8.calibrate(model, [model_inputs("llama")["input_ids"]])
    assert float(model.get_submodule(Q).input_scale) != 0.5
    model.save_pretrained(tmp_path)
    _only_given_left(tmp_path)
    with pytest.raises(CheckpointTensorError, match=r"lacks 13 input_scale"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_lost_scale_of_a_layer_without_config_scale_is_refused(tiny_model_dir, tmp_path):
    """Calibrated with a config naming q_proj; k_proj's scale lost: refused, named."""
    config = Fp8Config("static", activation_scales={Q: 0.5})
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    hf_fp8.calibrate(model, [model_inputs("llama")["input_ids"]])
    model.save_pretrained(tmp_path)
    key = "model.layers.0.self_attn.k_proj.input_scale"
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[key]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointTensorError, match=re.escape(key)):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_lost_given_scale_is_refused(tiny_model_dir, tmp_path):
    """Config names q_proj and k_proj; the checkpoint stores only q_proj's: refused."""
    k = "model.layers.0.self_attn.k_proj"
    config = Fp8Config("static", activation_scales={Q: 0.5, k: 0.25})
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[f"{k}.input_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointTensorError, match=re.escape(f"{k}.input_scale")):
        AutoModelForCausalLM.from_pretrained(tmp_path)
