"""peft LoRA on an FP8 base: dtype, frozen base, gradients, merge, adapter save / reload."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _fp8(tiny_model_dir, scheme="dynamic", dtype=torch.bfloat16):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama", dtype), dtype=dtype, quantization_config=Fp8Config(scheme)
    )


def _train_a_bit(model, steps=3):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    batch = model_inputs("llama")
    for _ in range(steps):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


@pytest.mark.parametrize("autocast", [True, False])
def test_adapter_dtype(autocast, tiny_model_dir):
    peft_model = get_peft_model(
        _fp8(tiny_model_dir),
        LoraConfig(r=4, target_modules=TARGETS),
        autocast_adapter_dtype=autocast,
    )
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.get_base_layer(), Fp8Linear)
    # peft's default upcasts bf16 adapters to fp32, exactly as for a plain bf16 base;
    # without autocast they take the FP8 layer's compute dtype, never fp8.
    expected = torch.float32 if autocast else torch.bfloat16
    assert layer.lora_A["default"].weight.dtype == expected
    assert layer.lora_B["default"].weight.dtype == expected


def test_training_changes_only_adapters(tiny_model_dir):
    peft_model = get_peft_model(_fp8(tiny_model_dir), LoraConfig(r=4, target_modules=TARGETS))
    before = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" not in k}
    first = peft_model(**model_inputs("llama"), labels=model_inputs("llama")["input_ids"]).loss
    last = _train_a_bit(peft_model)
    assert last < first
    after = peft_model.state_dict()
    for key, value in before.items():
        assert torch.equal(value.view(torch.uint8), after[key].view(torch.uint8)), key
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in after.items() if "lora_B" in k)


@pytest.mark.parametrize("scheme", ["dynamic", "static", "weight_only"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_activation_gradient_is_straight_through(scheme, granularity):
    """Under an adapter the input gradient is ``grad_out @ W`` with the dequantized FP8 weight
    (straight-through activation quantization), for every scheme and weight granularity."""
    torch.manual_seed(0)
    config = Fp8Config(
        scheme,
        weight_granularity=granularity,
        activation_scale=0.01 if scheme == "static" else None,
    )
    fp8 = Fp8Linear.from_linear(torch.nn.Linear(64, 48), config)
    x = torch.randn(3, 64, requires_grad=True)
    out = fp8(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected = grad_out @ fp8.dequantize_weight(torch.float32)
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)
    assert fp8.weight.grad is None


def test_merge_and_unload_gives_high_precision_model(tiny_model_dir):
    peft_model = get_peft_model(
        _fp8(tiny_model_dir, dtype=torch.float32), LoraConfig(r=4, target_modules=TARGETS)
    )
    _train_a_bit(peft_model)
    batch = model_inputs("llama")
    with torch.no_grad():
        expected = peft_model(**batch).logits
    merged = peft_model.merge_and_unload()
    q_proj = merged.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear and q_proj.weight.dtype == torch.float32
    assert isinstance(merged.model.layers[0].self_attn.k_proj, Fp8Linear)  # untouched layer
    with torch.no_grad():
        merged_out = merged(**batch).logits
    # dynamic FP8 activations are still applied by the adapter-free FP8 layers but not by the
    # merged (high-precision) ones: close, not equal
    assert (merged_out - expected).norm() / expected.norm() < 0.05
    requantized = hf_fp8.quantize_model(merged, Fp8Config("dynamic"), skip=["lm_head"])
    assert isinstance(requantized.model.layers[0].self_attn.q_proj, Fp8Linear)
    with torch.no_grad():
        assert (requantized(**batch).logits - expected).norm() / expected.norm() < 0.05


def test_merge_is_exact_for_weight_only_and_unmerge_restores_fp8(tiny_model_dir):
    peft_model = get_peft_model(
        _fp8(tiny_model_dir, "weight_only", torch.float32), LoraConfig(r=4, target_modules=TARGETS)
    )
    _train_a_bit(peft_model)
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    original = layer.get_base_layer()
    batch = model_inputs("llama")
    with torch.no_grad():
        expected = peft_model(**batch).logits
        layer.merge()
        assert type(layer.get_base_layer()) is torch.nn.Linear
        peft_model.base_model.merge_adapter()
        torch.testing.assert_close(peft_model(**batch).logits, expected, rtol=1e-4, atol=1e-4)
        peft_model.base_model.unmerge_adapter()
    assert layer.get_base_layer() is original


def test_adapter_save_and_reload_on_fresh_fp8_base(tiny_model_dir, tmp_path):
    peft_model = get_peft_model(_fp8(tiny_model_dir), LoraConfig(r=4, target_modules=TARGETS))
    _train_a_bit(peft_model)
    peft_model.eval()
    batch = model_inputs("llama")
    with torch.no_grad():
        expected = peft_model(**batch).logits
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(_fp8(tiny_model_dir), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, expected)


def test_merge_with_no_adapter_names_keeps_the_fp8_base(tiny_model_dir):
    """peft's ``check_adapters_to_merge`` runs before the FP8 base is dequantized."""
    peft_model = get_peft_model(_fp8(tiny_model_dir), LoraConfig(r=4, target_modules=TARGETS))
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    original = layer.get_base_layer()
    layer.merge(adapter_names=[])
    assert layer.get_base_layer() is original and isinstance(original, Fp8Linear)
    assert layer.merged is False and "_fp8_base" not in layer.__dict__
    layer.merge()
    with pytest.warns(UserWarning, match="All adapters are already merged"):
        layer.merge()  # a second merge: nothing to merge, the FP8 original is still kept
    layer.unmerge()
    assert layer.get_base_layer() is original


ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _merged(tiny_model_dir, targets):
    peft_model = get_peft_model(
        _fp8(tiny_model_dir, "weight_only", torch.float32), LoraConfig(r=4, target_modules=targets)
    )
    _train_a_bit(peft_model)
    return peft_model.merge_and_unload()


def _logits(model):
    with torch.no_grad():
        return model(**model_inputs("llama")).logits


def test_fully_merged_model_saves_as_a_plain_high_precision_checkpoint(tiny_model_dir, tmp_path):
    merged = _merged(tiny_model_dir, ALL_LINEARS)
    assert not any(isinstance(m, Fp8Linear) for m in merged.modules())
    merged.save_pretrained(tmp_path / "merged")
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    assert not (tmp_path / "merged" / "README.md").exists()  # no hf_fp8 card on a plain model
    assert merged.hf_quantizer is None and not getattr(merged, "is_quantized", False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.equal(_logits(reloaded), _logits(merged))


def test_partly_merged_model_saves_as_fp8_with_the_merged_layers_in_high_precision(
    tiny_model_dir, tmp_path
):
    merged = _merged(tiny_model_dir, TARGETS)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    attention = reloaded.model.layers[0].self_attn
    assert type(attention.q_proj) is torch.nn.Linear and isinstance(attention.k_proj, Fp8Linear)
    assert "model.layers.0.self_attn.q_proj" in (
        reloaded.config.quantization_config.modules_to_not_convert
    )
    assert torch.equal(_logits(reloaded), _logits(merged))


def test_requantized_merged_model_saves_as_fp8(tiny_model_dir, tmp_path):
    merged = _merged(tiny_model_dir, ALL_LINEARS)
    requantized = hf_fp8.quantize_model(merged, Fp8Config("weight_only"))
    requantized.save_pretrained(tmp_path / "fp8")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    assert isinstance(reloaded.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert torch.equal(_logits(reloaded), _logits(requantized))


def test_merged_layers_stay_frozen_like_on_a_plain_base(tiny_model_dir):
    """Merging keeps the base frozen (reference: peft on the plain model); unmerge puts the very
    FP8 layer back, bit for bit and frozen."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    reference = get_peft_model(plain, LoraConfig(r=4, target_modules=TARGETS))
    peft_model = get_peft_model(
        _fp8(tiny_model_dir, "weight_only", torch.float32), LoraConfig(r=4, target_modules=TARGETS)
    )

    def trainable(model):
        return sorted(name for name, p in model.named_parameters() if p.requires_grad)

    expected = trainable(reference)
    assert trainable(peft_model) == expected
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    original = layer.get_base_layer()
    codes = original.weight.detach().clone()
    reference.merge_adapter()
    peft_model.merge_adapter()
    assert trainable(peft_model) == trainable(reference) == expected
    peft_model.unmerge_adapter()
    assert layer.get_base_layer() is original and trainable(peft_model) == expected
    assert torch.equal(original.weight.view(torch.uint8), codes.view(torch.uint8))
    assert not original.weight.requires_grad and not original.weight_scale.requires_grad
    merged = peft_model.merge_and_unload()
    q_proj = merged.model.layers[0].self_attn.q_proj
    plain_q_proj = reference.merge_and_unload().model.layers[0].self_attn.q_proj
    assert q_proj.weight.requires_grad is plain_q_proj.weight.requires_grad is False
