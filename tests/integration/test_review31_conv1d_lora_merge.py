"""LoRA merged into an FP8 GPT-2 gives GPT-2's own ``Conv1D`` layers (reviewer R31).

``merge_and_unload()`` left the merged ``c_attn`` as an ``nn.Linear`` (``[out, in]``): the
merged model saved it under GPT-2's ``[in, out]`` name and did not reload (size mismatch).

Reference: peft on the float GPT-2 whose ``Conv1D`` layers hold the FP8 model's dequantized
weights (transposed; peft's LoRA there uses ``fan_in_fan_out=True``), with the same adapter
weights.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from hf_fp8 import Fp8Config, Fp8Linear
from tests.quantizer.test_review31_conv1d_dequantize import _conv1d_layers as _layers
from tests.quantizer.test_review31_conv1d_dequantize import _logits, _reference

TARGETS = ["c_attn", "attn.c_proj", "c_fc"]  # 64 -> 192, 64 -> 64 (square), 64 -> 256


def _fp8(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gpt2"), dtype=torch.float32, quantization_config=Fp8Config("weight_only")
    )


def _pair(tiny_model_dir, **config):
    """(peft model on the FP8 GPT-2, the same adapters on the reference)."""
    fp8 = _fp8(tiny_model_dir)
    ref = _reference(tiny_model_dir, fp8)
    with pytest.warns(UserWarning, match="fan_in_fan_out"):  # peft: Conv1D -> True
        reference = get_peft_model(ref, LoraConfig(r=4, target_modules=TARGETS, **config))
    peft_model = get_peft_model(fp8, LoraConfig(r=4, target_modules=TARGETS, **config))
    gen = torch.Generator().manual_seed(1)
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                assert ref_params[name].shape == param.shape, name
                param.copy_(
                    torch.randn(param.shape, generator=gen) * 0.3 + param * ("magnitude" in name)
                )
                ref_params[name].copy_(param)
    return peft_model, reference


def _check_merged_like_reference(merged, reference) -> None:
    for name, conv in _layers(reference).items():
        layer = _layers(merged)[name]
        if name.endswith("mlp.c_proj"):  # not a target: stays FP8
            assert isinstance(layer, Fp8Linear), name
            continue
        assert type(layer) is Conv1D, (name, type(layer))
        assert layer.weight.shape == conv.weight.shape, name
        assert torch.equal(layer.weight, conv.weight), name
        assert torch.equal(layer.bias, conv.bias), name


def test_merge_and_unload_gives_conv1d_layers_and_a_checkpoint_that_reloads(
    tiny_model_dir, tmp_path
):
    peft_model, reference = _pair(tiny_model_dir)
    expected_unmerged = _logits(reference)
    torch.testing.assert_close(_logits(peft_model), expected_unmerged, rtol=1e-5, atol=1e-5)

    merged = peft_model.merge_and_unload()
    ref_merged = reference.merge_and_unload()
    _check_merged_like_reference(merged, ref_merged)
    expected = _logits(merged)
    torch.testing.assert_close(expected, _logits(ref_merged), rtol=1e-5, atol=1e-5)

    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    _check_merged_like_reference(reloaded, ref_merged)
    assert torch.equal(_logits(reloaded), expected)


def test_merged_and_dequantized_gpt2_saves_a_float_checkpoint_that_reloads(
    tiny_model_dir, tmp_path
):
    peft_model, reference = _pair(tiny_model_dir)
    merged = peft_model.merge_and_unload().dequantize()
    ref_merged = reference.merge_and_unload()
    for name, conv in _layers(ref_merged).items():
        layer = _layers(merged)[name]
        assert type(layer) is Conv1D, (name, type(layer))
        assert torch.equal(layer.weight, conv.weight), name
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(m, Fp8Linear) for m in reloaded.modules())
    assert torch.equal(_logits(reloaded), _logits(merged))


def test_unmerge_brings_the_fp8_layer_back_bit_for_bit(tiny_model_dir):
    peft_model, reference = _pair(tiny_model_dir)
    before = {n: t.clone() for n, t in peft_model.state_dict().items()}
    peft_model.merge_adapter()
    reference.merge_adapter()
    torch.testing.assert_close(_logits(peft_model), _logits(reference), rtol=1e-5, atol=1e-5)
    layer = peft_model.base_model.model.transformer.h[0].attn.c_attn
    assert type(layer.get_base_layer()) is Conv1D
    peft_model.unmerge_adapter()
    assert isinstance(layer.get_base_layer(), Fp8Linear)
    assert layer.fan_in_fan_out is False
    after = peft_model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}], ids=["lora", "dora"])
def test_dequantize_while_merged_then_unmerge_matches_the_reference(
    tiny_model_dir, tmp_path, variant
):
    peft_model, reference = _pair(tiny_model_dir, **variant)
    peft_model.merge_adapter()
    peft_model.get_base_model().dequantize()
    reference.merge_adapter()
    torch.testing.assert_close(_logits(peft_model), _logits(reference), rtol=1e-5, atol=1e-5)
    peft_model.unmerge_adapter()
    reference.unmerge_adapter()
    assert not any(isinstance(m, Fp8Linear) for m in peft_model.modules())
    got = {n: p for n, p in peft_model.named_parameters()}
    for name, param in reference.named_parameters():
        assert got[name].shape == param.shape, name
        assert torch.equal(got[name], param), name
    plain = peft_model.unload()
    plain.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(_logits(reloaded), _logits(reference.unload()))


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}], ids=["lora", "dora"])
def test_dequantize_of_the_peft_model_then_merge_matches_the_reference(tiny_model_dir, variant):
    """Unmerged, dequantized: the LoRA layers now sit on Conv1D bases and merge as peft's."""
    peft_model, reference = _pair(tiny_model_dir, **variant)
    peft_model.get_base_model().dequantize()
    layer = peft_model.base_model.model.transformer.h[1].attn.c_attn
    assert type(layer.get_base_layer()) is Conv1D
    assert layer.fan_in_fan_out is True
    assert torch.equal(_logits(peft_model), _logits(reference))
    merged = peft_model.merge_and_unload()
    _check_merged_like_reference_all(merged, reference.merge_and_unload())


def _check_merged_like_reference_all(merged, reference) -> None:
    for name, conv in _layers(reference).items():
        layer = _layers(merged)[name]
        assert type(layer) is Conv1D, (name, type(layer))
        assert torch.equal(layer.weight, conv.weight), name


def test_dora_merge_gives_conv1d_layers_as_on_the_reference(tiny_model_dir, tmp_path):
    peft_model, reference = _pair(tiny_model_dir, use_dora=True)
    torch.testing.assert_close(_logits(peft_model), _logits(reference), rtol=1e-5, atol=1e-5)
    merged = peft_model.merge_and_unload()
    ref_merged = reference.merge_and_unload()
    _check_merged_like_reference(merged, ref_merged)
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(_logits(reloaded), _logits(merged))


def test_fan_in_fan_out_follows_the_base_and_cannot_be_set_against_it(tiny_model_dir):
    peft_model, _ = _pair(tiny_model_dir)
    layer = peft_model.base_model.model.transformer.h[0].mlp.c_fc
    with pytest.raises(ValueError, match="follows the base"):
        layer.fan_in_fan_out = True  # the FP8 base stores [out, in]
    layer.fan_in_fan_out = False  # what it is: accepted
    layer.merge()
    assert layer.fan_in_fan_out is True
    with pytest.raises(ValueError, match="Conv1D"):
        layer.fan_in_fan_out = False
    layer.unmerge()
    assert layer.fan_in_fan_out is False
