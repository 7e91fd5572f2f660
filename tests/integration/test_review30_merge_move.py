"""``merge_adapter()``, ``model.to(...)``, ``unmerge_adapter()`` on an FP8 base (reviewer R30 F5).

A merged layer keeps its FP8 original outside the module tree, for ``unmerge``; ``.to()`` did
not reach it, so the FP8 layer came back on the old device (on CUDA: a CPU layer in a GPU
model) or in the old compute dtype. Without a GPU, the meta device stands for "another
device". Reference: the same flow on the dequantized model.
"""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs


def _pair(tiny_model_dir):
    fp8 = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32, quantization_config=Fp8Config("weight_only")
    )
    config = dict(r=4, target_modules=["q_proj"])
    reference = get_peft_model(copy.deepcopy(fp8).dequantize(), LoraConfig(**config))
    return get_peft_model(fp8, LoraConfig(**config)), reference


def _q_proj(peft_model):
    return peft_model.base_model.model.model.layers[0].self_attn.q_proj


def test_unmerge_after_a_move_puts_the_fp8_layer_on_the_new_device(tiny_model_dir):
    peft_model, reference = _pair(tiny_model_dir)
    for model in (peft_model, reference):
        model.merge_adapter()
        model.to("meta")
        model.unmerge_adapter()
    assert all(p.is_meta for p in reference.parameters())

    base = _q_proj(peft_model).get_base_layer()
    assert isinstance(base, Fp8Linear)
    assert base.weight.is_meta and base.weight_scale.is_meta
    assert all(p.is_meta for p in peft_model.parameters())


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("llama")).logits.float()


def test_unmerge_after_a_dtype_cast_gives_the_fp8_layer_the_new_compute_dtype(tiny_model_dir):
    peft_model, reference = _pair(tiny_model_dir)
    gen = torch.Generator().manual_seed(1)
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
                ref_params[name].copy_(param)
    for model in (peft_model, reference):
        model.merge_adapter()
        model.to(torch.bfloat16)
        model.unmerge_adapter()

    layer = _q_proj(peft_model)
    base = layer.get_base_layer()
    assert isinstance(base, Fp8Linear) and base.weight.dtype == torch.float8_e4m3fn
    assert base.compute_dtype == torch.bfloat16
    assert layer.lora_A["default"].weight.dtype == torch.bfloat16
    assert _q_proj(reference).get_base_layer().weight.dtype == torch.bfloat16
    got, expected = _logits(peft_model), _logits(reference)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)  # bf16 rounding apart
