"""GPT-2 (``Conv1D``) dequantized comes back as GPT-2's own ``Conv1D`` layers (reviewer R31).

``model.dequantize()`` and ``Fp8Config(dequantize=True)`` returned ``nn.Linear`` layers
(``[out, in]`` weights); ``save_pretrained`` wrote them under GPT-2's ``[in, out]`` names, so
the folder did not reload (size mismatch), and with ``ignore_mismatched_sizes=True`` the
non-square layers came back random and the square ``attn.c_proj`` silently transposed.

Reference: the float GPT-2 whose ``Conv1D`` weights are the FP8 layers' dequantized weights
(transposed) and biases, set here by hand.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs

CONV1D = (
    "attn.c_attn",
    "attn.c_proj",
    "mlp.c_fc",
    "mlp.c_proj",
)  # 64->192, 64->64, 64->256, 256->64


def _fp8(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gpt2"), dtype=torch.float32, quantization_config=Fp8Config("weight_only")
    )


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("gpt2")).logits


def _reference(tiny_model_dir, fp8) -> nn.Module:
    """The float GPT-2 holding ``fp8``'s dequantized weights in its own Conv1D layers."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gpt2"), dtype=torch.float32)
    with torch.no_grad():
        for block, fp8_block in zip(ref.transformer.h, fp8.transformer.h, strict=True):
            for name in CONV1D:
                conv, layer = block.get_submodule(name), fp8_block.get_submodule(name)
                assert isinstance(conv, Conv1D) and isinstance(layer, Fp8Linear)
                conv.weight.copy_(layer.dequantize_weight(torch.float32).t())
                conv.bias.copy_(layer.bias)
    return ref


def _conv1d_layers(model) -> dict[str, nn.Module]:
    return {
        f"{i}.{name}": block.get_submodule(name)
        for i, block in enumerate(model.transformer.h)
        for name in CONV1D
    }


def _check_like_reference(model, ref) -> None:
    got, expected = _conv1d_layers(model), _conv1d_layers(ref)
    for name, conv in expected.items():
        layer = got[name]
        assert type(layer) is Conv1D, (name, type(layer))
        assert (layer.nf, layer.nx) == (conv.nf, conv.nx), name
        assert layer.weight.shape == conv.weight.shape, name
        assert torch.equal(layer.weight, conv.weight), name
        assert torch.equal(layer.bias, conv.bias), name
        assert layer.weight.is_contiguous(), name


def test_model_dequantize_gives_gpt2_conv1d_layers_and_a_checkpoint_that_reloads(
    tiny_model_dir, tmp_path
):
    fp8 = _fp8(tiny_model_dir)
    ref = _reference(tiny_model_dir, fp8)
    model = copy.deepcopy(fp8).dequantize()

    _check_like_reference(model, ref)
    expected = _logits(ref)
    assert torch.equal(_logits(model), expected)
    # the flags of a float load (the dequantized model trains as one)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert flags == {n: p.requires_grad for n, p in ref.named_parameters()}

    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert not any(isinstance(m, Fp8Linear) for m in reloaded.modules())
    _check_like_reference(reloaded, ref)
    assert torch.equal(_logits(reloaded), expected)


def test_dequantize_to_a_dtype_gives_conv1d_layers_in_that_dtype(tiny_model_dir):
    fp8 = _fp8(tiny_model_dir)
    expected = fp8.transformer.h[1].attn.c_attn.dequantize_weight(torch.float32)
    expected = expected.to(torch.bfloat16).t()
    model = fp8.dequantize(dtype=torch.bfloat16)
    layer = model.transformer.h[1].attn.c_attn
    assert type(layer) is Conv1D
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight, expected)


def test_fp8_checkpoint_loaded_with_dequantize_true_gives_conv1d_and_reloads(
    tiny_model_dir, tmp_path
):
    fp8 = _fp8(tiny_model_dir)
    ref = _reference(tiny_model_dir, fp8)
    fp8.save_pretrained(tmp_path / "fp8")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=Fp8Config("weight_only", dequantize=True)
    )

    _check_like_reference(model, ref)
    expected = _logits(ref)
    assert torch.equal(_logits(model), expected)

    model.save_pretrained(tmp_path / "hp")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hp", dtype=torch.float32)
    _check_like_reference(reloaded, ref)
    assert torch.equal(_logits(reloaded), expected)


def test_a_conv1d_checkpoint_requantizes_after_the_round_trip(tiny_model_dir, tmp_path):
    """The dequantized GPT-2 saved and loaded with Fp8Config again is the FP8 model again:
    Conv1D weights go through their transpose as the first load's did."""
    fp8 = _fp8(tiny_model_dir)
    expected = _logits(fp8)
    copy.deepcopy(fp8).dequantize().save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=Fp8Config("weight_only")
    )
    for name, layer in _conv1d_layers(again).items():
        assert isinstance(layer, Fp8Linear), name
        assert torch.equal(
            layer.weight.view(torch.uint8), _conv1d_layers(fp8)[name].weight.view(torch.uint8)
        )
    assert torch.equal(_logits(again), expected)


def test_quantize_model_then_dequantize_gives_conv1d_layers(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gpt2"), dtype=torch.float32)
    hf_fp8.quantize_model(model, Fp8Config("weight_only"))
    ref = _reference(tiny_model_dir, model)
    model.dequantize()
    _check_like_reference(model, ref)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(_logits(reloaded), _logits(ref))
