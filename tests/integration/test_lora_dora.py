"""DoRA on an FP8 base reads the dequantized weight; inits that rewrite the base are refused.

Reference: the same peft flow on the dequantized FP8 model (``model.dequantize()``), which holds
exactly the weights the FP8 layers compute with (weight-only, fp32: equal up to summation order).
"""

from __future__ import annotations

import pytest
import torch
from peft import KasaConfig, LoftQConfig, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _llama(tiny_model_dir, kind: str, dtype=torch.float32):
    extra = {} if kind == "plain" else {"quantization_config": Fp8Config("weight_only")}
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama", dtype), dtype=dtype, **extra
    )
    return model.dequantize() if kind == "dequantized" else model


def _dora(tiny_model_dir, kind: str, dtype=torch.float32, **config):
    torch.manual_seed(0)  # the same lora_A init for every kind
    model = get_peft_model(
        _llama(tiny_model_dir, kind, dtype),
        LoraConfig(r=4, target_modules=TARGETS, use_dora=True, **config),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # stands for a trained adapter
    return model


def _magnitudes(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_magnitude_vector" in k}


def _loss(model, seed=None):
    batch = model_inputs("llama")
    if seed is not None:
        torch.manual_seed(seed)  # the same dropout masks in both models
    return model(**batch, labels=batch["input_ids"]).loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dora_magnitude_is_the_norm_of_the_dequantized_weight(tiny_model_dir, dtype):
    fp8 = _magnitudes(_dora(tiny_model_dir, "fp8", dtype))
    reference = _magnitudes(_dora(tiny_model_dir, "dequantized", dtype))
    assert fp8.keys() == reference.keys() and len(fp8) == 2 * len(TARGETS)
    for key, value in reference.items():
        assert fp8[key].dtype == value.dtype, key
        torch.testing.assert_close(fp8[key], value, rtol=1e-6, atol=0, msg=key)
    # and close to DoRA on the original high-precision model (FP8 rounding of the weight only)
    for key, value in _magnitudes(_dora(tiny_model_dir, "plain", dtype)).items():
        assert ((fp8[key].float() - value.float()).norm() / value.float().norm()) < 0.02, key


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dora_training_step_matches_the_dequantized_model(tiny_model_dir, dropout):
    """Forward and the adapter gradients (magnitude included); dropout > 0 takes DoRA's other
    path (it recomputes the base output from the weight)."""
    models = [_dora(tiny_model_dir, kind, lora_dropout=dropout) for kind in ("fp8", "dequantized")]
    losses = []
    for model in models:
        model.train()
        loss = _loss(model, seed=2)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    fp8, reference = (
        {n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in models
    )
    assert fp8.keys() == reference.keys() and any("magnitude" in k for k in fp8)
    for key, grad in reference.items():
        torch.testing.assert_close(fp8[key], grad, rtol=1e-4, atol=1e-6, msg=key)
    layer = models[0].base_model.model.model.layers[0].self_attn.q_proj
    assert (
        isinstance(layer.get_base_layer(), Fp8Linear) and layer.get_base_layer().weight.grad is None
    )


@pytest.mark.parametrize("safe_merge", [False, True])
def test_dora_merge_and_unmerge_match_the_dequantized_model(tiny_model_dir, safe_merge):
    fp8, reference = (_dora(tiny_model_dir, kind).eval() for kind in ("fp8", "dequantized"))
    batch = model_inputs("llama")
    with torch.no_grad():
        expected = reference(**batch).logits
        torch.testing.assert_close(fp8(**batch).logits, expected, rtol=1e-4, atol=1e-4)
        layer = fp8.base_model.model.model.layers[0].self_attn.q_proj
        original = layer.get_base_layer()
        fp8.merge_adapter(safe_merge=safe_merge)
        assert type(layer.get_base_layer()) is torch.nn.Linear
        torch.testing.assert_close(fp8(**batch).logits, expected, rtol=1e-4, atol=1e-4)
        fp8.unmerge_adapter()
        assert layer.get_base_layer() is original
        torch.testing.assert_close(fp8(**batch).logits, expected, rtol=1e-4, atol=1e-4)
        merged = fp8.merge_and_unload(safe_merge=safe_merge)
        reference_merged = reference.merge_and_unload(safe_merge=safe_merge)
        for name, module in reference_merged.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in TARGETS:
                torch.testing.assert_close(
                    merged.get_submodule(name).weight, module.weight, rtol=1e-5, atol=1e-6
                )
        torch.testing.assert_close(merged(**batch).logits, expected, rtol=1e-4, atol=1e-4)


def test_two_dora_adapters_merge_in_turn_like_on_the_dequantized_model(tiny_model_dir):
    """peft's DoRA merge of a second adapter unmerges and re-merges the first one: the base must
    stay the dequantized copy through that replay."""
    models = []
    for kind in ("fp8", "dequantized"):
        model = _dora(tiny_model_dir, kind)
        torch.manual_seed(3)
        model.add_adapter("other", LoraConfig(r=4, target_modules=TARGETS, use_dora=True))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B.other" in name:
                    param.normal_(0, 0.05)
        model.base_model.set_adapter(["default", "other"])
        models.append(model.eval())
    batch = model_inputs("llama")
    with torch.no_grad():
        expected = models[1](**batch).logits
        torch.testing.assert_close(models[0](**batch).logits, expected, rtol=1e-4, atol=1e-4)
        models[0].base_model.merge_adapter(["default", "other"])
        torch.testing.assert_close(models[0](**batch).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "extra",
    [
        {"init_lora_weights": "pissa"},
        {"init_lora_weights": "pissa_niter_4"},
        {"init_lora_weights": "olora"},
        {"init_lora_weights": "corda"},
        {"init_lora_weights": "loftq", "loftq_config": LoftQConfig(loftq_bits=4)},
        {"init_lora_weights": "lora_ga"},
        {"kasa_config": KasaConfig()},
    ],
    ids=lambda extra: str(extra.get("init_lora_weights", "kasa")),
)
def test_inits_that_rewrite_the_base_weight_are_refused_with_the_fix(tiny_model_dir, extra):
    model = _llama(tiny_model_dir, "fp8")
    with pytest.raises(
        ValueError, match=r"rewrites the base weight.*dequantize=True.*quantize_model"
    ):
        get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, **extra))


def test_mica_init_reads_the_dequantized_weight(tiny_model_dir):
    """MiCA's ``lora_B`` is built from the base weight's singular vectors (read, not changed)."""
    adapters = []
    for kind in ("fp8", "dequantized"):
        config = LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="mica")
        model = get_peft_model(_llama(tiny_model_dir, kind), config)
        adapters.append({k: v for k, v in model.state_dict().items() if "lora_" in k})
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for key, value in adapters[1].items():
        torch.testing.assert_close(adapters[0][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert all(v.abs().sum() > 0 for k, v in adapters[0].items() if "lora_B" in k)
