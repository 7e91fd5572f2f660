"""Dequantizing an FP8 model (R7 findings 1 and 2): disk-offloaded layers, a string dtype.

References: the model dequantized in memory, and the FP8 model itself."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import LLAMA_LAYER_1_ON_DISK, model_inputs, model_output


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model_output(model, model_inputs("llama"))


def test_dequantize_flag_with_a_layer_on_disk_is_refused(llama_fp8_dir, tmp_path):
    """It loaded, with logits ~1.1 relative error from the dequantized model: the offloaded
    layer's fp8 codes were read as float weights without their scales."""
    with pytest.raises(ValueError, match="disk") as err:
        AutoModelForCausalLM.from_pretrained(
            llama_fp8_dir,
            device_map=LLAMA_LAYER_1_ON_DISK,
            offload_folder=str(tmp_path / "offload"),
            quantization_config=Fp8Config("dynamic", dequantize=True),
        )
    assert "dequantize" in str(err.value)


def test_model_dequantize_with_a_layer_on_disk_is_refused_and_changes_nothing(
    llama_fp8_dir, tmp_path
):
    in_memory = AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    offloaded = AutoModelForCausalLM.from_pretrained(
        llama_fp8_dir, device_map=LLAMA_LAYER_1_ON_DISK, offload_folder=str(tmp_path / "off")
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\..*disk"):
        offloaded.dequantize()
    # refused before any layer was swapped: still the FP8 model, same numbers
    assert isinstance(offloaded.model.layers[0].mlp.down_proj, Fp8Linear)
    assert isinstance(offloaded.model.layers[1].mlp.down_proj, Fp8Linear)
    torch.testing.assert_close(_logits(offloaded), _logits(in_memory), rtol=0, atol=0)


def test_dequantize_after_save_pretrained_accepts_the_string_dtype(tiny_model_dir, tmp_path):
    """save_pretrained leaves config.dtype as the string 'float32'; transformers passes it."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )
    reference = copy.deepcopy(model).dequantize()
    model.save_pretrained(tmp_path)
    assert model.config.dtype == "float32"
    model.dequantize()
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=0)


def test_dequantize_to_a_string_dtype_and_unknown_names_refused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )
    with pytest.raises(ValueError, match="float33"):
        model.dequantize(dtype="float33")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        model.dequantize(dtype="float8_e4m3fn")  # not a compute dtype
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)  # nothing swapped
    expected = model.model.layers[0].mlp.down_proj.dequantize_weight().to(torch.bfloat16)
    model.dequantize(dtype="bfloat16")
    weight = model.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16
    torch.testing.assert_close(weight, expected, rtol=0, atol=0)


def test_model_dequantize_with_moe_experts_on_disk_is_refused(tmp_path):
    import transformers as tf

    from hf_fp8.modules.fp8_experts import Fp8Experts
    from tests.tiny_models import tiny_mixtral

    torch.manual_seed(0)
    tiny_mixtral().save_pretrained(tmp_path / "hp")
    tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("dynamic")
    ).save_pretrained(tmp_path / "fp8")
    in_memory = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1.self_attn": "cpu",
        "model.layers.1.input_layernorm": "cpu",
        "model.layers.1.post_attention_layernorm": "cpu",
        "model.layers.1.mlp.gate": "cpu",
        "model.layers.1.mlp.experts": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    offloaded = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", device_map=device_map, offload_folder=str(tmp_path / "off")
    )
    experts = offloaded.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts)
    with pytest.raises(
        ValueError, match=r"1 offloaded FP8 layer\(s\) \(model\.layers\.1\.mlp\.experts\)"
    ):
        offloaded.dequantize()
    assert offloaded.model.layers[1].mlp.experts is experts
    torch.testing.assert_close(_logits(offloaded), _logits(in_memory), rtol=0, atol=0)
