"""``model.dequantize()`` on a peft-wrapped FP8 model (reviewer R30).

F1: the dequantized layers came back trainable (``nn.Parameter`` defaults to
``requires_grad=True``): 1,792 trainable parameters became 75,520, the whole base, silently.
F2: dequantized while an adapter was merged, ``unmerge_adapter()`` (or a forward under
``disable_adapter()``) put the kept FP8 layers back into the unquantized model, whose
``save_pretrained`` then wrote fp8 codes without a ``quantization_config`` (unloadable).

Reference: the same peft flow on the dequantized model (``Fp8Config`` load, then
``dequantize()``), with the same adapter weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from tests.tiny_models import model_inputs, tiny_mixtral


def _fp8(tiny_model_dir, family="llama"):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(family), dtype=torch.float32, quantization_config=Fp8Config("weight_only")
    )


def _flags(model) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


def _logits(model, family="llama") -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(family)).logits


def _same_adapters(peft_model, reference) -> None:
    """Random (nonzero) adapter weights in ``peft_model``, copied into ``reference``."""
    gen = torch.Generator().manual_seed(1)
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
                ref_params[name].copy_(param)


@pytest.mark.parametrize(
    ("family", "targets", "bias"),
    [
        ("llama", ["q_proj", "v_proj"], "none"),
        ("gpt2", ["c_attn"], "none"),
        ("gpt2", ["c_attn"], "all"),  # peft trains every bias: they keep that flag
    ],
)
def test_dequantize_keeps_the_frozen_base_of_a_peft_model(tiny_model_dir, family, targets, bias):
    config = dict(r=4, target_modules=targets, bias=bias)
    fp8 = _fp8(tiny_model_dir, family)
    reference = get_peft_model(copy.deepcopy(fp8).dequantize(), LoraConfig(**config))
    peft_model = get_peft_model(fp8, LoraConfig(**config))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)

    peft_model.get_base_model().dequantize()

    assert not any(isinstance(m, Fp8Linear) for m in peft_model.modules())
    assert _flags(peft_model) == _flags(reference)
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == trainable


def test_dequantize_of_a_plain_fp8_model_is_trainable_as_a_float_load(tiny_model_dir):
    """Without peft nothing changes: every parameter trains, as after a float load."""
    float_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gpt2"))
    model = _fp8(tiny_model_dir, "gpt2").dequantize()
    assert _flags(model) == _flags(float_model)
    assert all(_flags(model).values())


def test_dequantize_after_peft_unload_keeps_the_base_frozen(tiny_model_dir):
    """peft's ``unload()`` drops the adapters and ``peft_config`` but leaves the base frozen."""
    config = dict(r=4, target_modules=["q_proj"])
    fp8 = _fp8(tiny_model_dir)
    reference = get_peft_model(copy.deepcopy(fp8).dequantize(), LoraConfig(**config)).unload()
    model = get_peft_model(fp8, LoraConfig(**config)).unload()
    model.dequantize()
    assert _flags(model) == _flags(reference)
    assert not any(_flags(model).values())


def test_dequantize_of_a_frozen_model_stays_frozen(tiny_model_dir):
    """``model.requires_grad_(False)`` before ``dequantize()``: frozen, as the float model."""
    float_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gpt2")).requires_grad_(False)
    model = _fp8(tiny_model_dir, "gpt2").requires_grad_(False).dequantize()
    assert _flags(model) == _flags(float_model)


def test_dequantize_keeps_fp8_experts_frozen_under_peft():
    """FP8 MoE experts next to LoRA on the attention: frozen after dequantize, as peft left
    the dequantized experts of the reference."""
    torch.manual_seed(0)
    fp8 = quantize_model(tiny_mixtral(), Fp8Config("weight_only"))
    assert any(type(m).__name__ == "Fp8Experts" for m in fp8.modules())
    config = dict(r=4, target_modules=["q_proj"])
    reference = get_peft_model(copy.deepcopy(fp8).dequantize(), LoraConfig(**config))
    peft_model = get_peft_model(fp8, LoraConfig(**config))
    peft_model.get_base_model().dequantize()
    assert _flags(peft_model) == _flags(reference)
    assert not any("experts" in n for n, p in peft_model.named_parameters() if p.requires_grad)


def _merged_then_dequantized(tiny_model_dir):
    """(peft model merged, then dequantized; the reference: dequantized, then merged)."""
    fp8 = _fp8(tiny_model_dir)
    config = dict(r=4, target_modules=["q_proj", "v_proj"])
    reference = get_peft_model(copy.deepcopy(fp8).dequantize(), LoraConfig(**config))
    peft_model = get_peft_model(fp8, LoraConfig(**config))
    _same_adapters(peft_model, reference)
    peft_model.merge_adapter()
    peft_model.get_base_model().dequantize()
    reference.merge_adapter()
    return peft_model, reference


def _base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" not in n}


def test_unmerge_after_dequantize_stays_high_precision(tiny_model_dir):
    peft_model, reference = _merged_then_dequantized(tiny_model_dir)
    assert torch.equal(_logits(peft_model), _logits(reference))

    peft_model.unmerge_adapter()
    reference.unmerge_adapter()

    assert not any(isinstance(m, Fp8Linear) for m in peft_model.modules())
    got, expected = _base_weights(peft_model), _base_weights(reference)
    assert got.keys() == expected.keys()
    for name, weight in expected.items():
        assert got[name].dtype == weight.dtype, name
        assert torch.equal(got[name], weight), name
    assert torch.equal(_logits(peft_model), _logits(reference))
    # merging again works on the dense base, as on the reference
    peft_model.merge_adapter()
    reference.merge_adapter()
    assert torch.equal(_logits(peft_model), _logits(reference))


def test_disable_adapter_after_dequantize_stays_high_precision(tiny_model_dir):
    peft_model, reference = _merged_then_dequantized(tiny_model_dir)
    with peft_model.disable_adapter(), reference.disable_adapter():
        assert torch.equal(_logits(peft_model), _logits(reference))
    assert not any(isinstance(m, Fp8Linear) for m in peft_model.modules())


def test_unmerged_after_dequantize_saves_a_loadable_model(tiny_model_dir, tmp_path):
    peft_model, reference = _merged_then_dequantized(tiny_model_dir)
    peft_model.unmerge_adapter()
    reference.unmerge_adapter()
    plain = peft_model.unload()
    expected = _logits(reference.unload())

    plain.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)

    assert not any(isinstance(m, Fp8Linear) for m in reloaded.modules())
    assert torch.equal(_logits(reloaded), expected)
