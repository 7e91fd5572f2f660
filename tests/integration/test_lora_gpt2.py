"""A GPT-2 (Conv1D) LoRA adapter on the FP8 GPT-2, whose ``Fp8Linear`` stores ``[out, in]``.

peft saves ``fan_in_fan_out=true`` for an adapter trained on the plain GPT-2 (Conv1D stores
``[in, out]``); on an ``Fp8Linear`` base it must act as for an ``nn.Linear`` (peft's own rule:
``fan_in_fan_out`` forced False). A merge puts GPT-2's own ``Conv1D`` back (the flag then
``True``, as peft has it there). Reference: the same adapter on the dequantized FP8 model,
whose layers are GPT-2's ``Conv1D`` holding the dequantized weights (R31; it used to be an
``nn.Linear`` model, with ``fan_in_fan_out`` forced False).
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs

TARGETS = ["c_attn", "attn.c_proj", "c_fc"]  # c_attn: 64 -> 192, c_fc: 64 -> 256 (not square)


def _gpt2(tiny_model_dir, *, fp8: bool = False, dequantized: bool = False):
    extra = {"quantization_config": Fp8Config("weight_only")} if fp8 or dequantized else {}
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gpt2"), dtype=torch.float32, **extra
    )
    return model.dequantize() if dequantized else model


@pytest.fixture(scope="module")
def plain_adapter(tiny_model_dir, tmp_path_factory):
    """An adapter made on the plain GPT-2 (peft sets and saves fan_in_fan_out=True)."""
    torch.manual_seed(0)
    peft_model = get_peft_model(_gpt2(tiny_model_dir), LoraConfig(r=4, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # stands for a trained adapter
    path = tmp_path_factory.mktemp("gpt2_adapter")
    peft_model.save_pretrained(path)
    assert json.loads((path / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    return path


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("gpt2")).logits


def _target(model, name: str):
    path = name if "." in name else ("attn." if name == "c_attn" else "mlp.") + name
    return model.transformer.h[0].get_submodule(path)


def test_plain_gpt2_adapter_on_fp8_base_forwards_and_merges_as_on_the_dequantized_model(
    tiny_model_dir, plain_adapter
):
    reference = PeftModel.from_pretrained(_gpt2(tiny_model_dir, dequantized=True), plain_adapter)
    for name in TARGETS:  # the true reference: GPT-2's Conv1D, peft's fan_in_fan_out=True
        layer = _target(reference.base_model.model, name)
        assert type(layer.get_base_layer()) is Conv1D
        assert layer.fan_in_fan_out is True
    expected = _logits(reference)
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        peft_model = PeftModel.from_pretrained(_gpt2(tiny_model_dir, fp8=True), plain_adapter)
    for name in TARGETS:
        layer = _target(peft_model.base_model.model, name)
        assert isinstance(layer.get_base_layer(), Fp8Linear)
        assert layer.fan_in_fan_out is False
    # weight-only fp32: the FP8 base computes with exactly the dequantized weight
    unmerged = _logits(peft_model)
    torch.testing.assert_close(unmerged, expected, rtol=1e-4, atol=1e-4)
    assert (unmerged - _logits(_gpt2(tiny_model_dir, fp8=True))).abs().max() > 0.1  # it acts
    merged = peft_model.merge_and_unload()
    torch.testing.assert_close(_logits(merged), expected, rtol=1e-4, atol=1e-4)
    ref_merged = reference.merge_and_unload()
    for name in TARGETS:  # peft's merge on the Conv1D reference, bit for bit
        layer, ref_layer = _target(merged, name), _target(ref_merged, name)
        assert type(layer) is Conv1D
        assert torch.equal(layer.weight, ref_layer.weight), name
        assert torch.equal(layer.bias, ref_layer.bias), name


def test_fan_in_fan_out_config_on_a_fresh_fp8_gpt2_is_reset_like_for_nn_linear(tiny_model_dir):
    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        peft_model = get_peft_model(_gpt2(tiny_model_dir, fp8=True), config)
    assert peft_model.peft_config["default"].fan_in_fan_out is False
    layer = peft_model.base_model.model.transformer.h[1].attn.c_attn
    assert layer.fan_in_fan_out is False
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
        expected = layer(torch.ones(1, 64))
        layer.merge()
        torch.testing.assert_close(layer(torch.ones(1, 64)), expected, rtol=1e-4, atol=1e-4)
        assert type(layer.get_base_layer()) is Conv1D  # merged: GPT-2's layer, [in, out]
        assert layer.fan_in_fan_out is True
        layer.unmerge()
        assert isinstance(layer.get_base_layer(), Fp8Linear)
        assert layer.fan_in_fan_out is False
        torch.testing.assert_close(layer(torch.ones(1, 64)), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", ["none", "all"])
def test_merge_keeps_the_trainable_set_of_the_plain_model(tiny_model_dir, bias):
    """GPT-2 layers have biases: a merge keeps each flag as peft leaves it on the plain model."""
    config = dict(r=4, target_modules=["c_attn"], bias=bias)
    reference = get_peft_model(_gpt2(tiny_model_dir), LoraConfig(**config))
    peft_model = get_peft_model(_gpt2(tiny_model_dir, fp8=True), LoraConfig(**config))

    def trainable(model):
        return sorted(name for name, p in model.named_parameters() if p.requires_grad)

    expected = trainable(reference)
    assert trainable(peft_model) == expected
    reference.merge_adapter()
    peft_model.merge_adapter()
    assert trainable(peft_model) == trainable(reference) == expected
    peft_model.unmerge_adapter()
    assert trainable(peft_model) == expected
