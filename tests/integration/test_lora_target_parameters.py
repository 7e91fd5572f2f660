"""peft ``target_parameters`` naming an FP8 linear's ``weight``: hf_fp8's LoRA layer takes it
(``Fp8LoraLinear``, the same math as peft's ``ParamWrapper`` on a plain linear), with the adapter
keys and shapes, outputs and merge of the same adapter on the dequantized model."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from hf_fp8 import Fp8Config, quantize_model
from hf_fp8.lora import Fp8LoraLinear
from tests.tiny_models import TINY, model_inputs


def test_target_parameters_on_an_fp8_linear_weight_matches_the_dequantized_model():
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    fp8 = quantize_model(model_cls(config_cls(**kwargs)), Fp8Config("weight_only"))
    dense = copy.deepcopy(fp8).dequantize()
    batch = model_inputs("llama")
    results = []
    for model in (fp8, dense):
        config = LoraConfig(
            r=4, target_modules=[], target_parameters=["q_proj.weight"], init_lora_weights=False
        )
        torch.manual_seed(1)
        peft_model = get_peft_model(model, config)
        adapters = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
        with torch.no_grad():
            logits = peft_model(**batch).logits
            merged = peft_model.merge_and_unload()(**batch).logits
        results.append((adapters, logits, merged))
    (fp8_adapters, fp8_logits, fp8_merged), (ref_adapters, ref_logits, ref_merged) = results
    assert {k: v.shape for k, v in fp8_adapters.items()} == {
        k: v.shape for k, v in ref_adapters.items()
    }
    for key, value in fp8_adapters.items():
        assert torch.equal(value, ref_adapters[key]), key
    torch.testing.assert_close(fp8_logits, ref_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fp8_merged, ref_merged, rtol=1e-4, atol=1e-5)


def test_target_parameters_on_an_fp8_linear_weight_builds_the_fp8_lora_layer():
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    fp8 = quantize_model(model_cls(config_cls(**kwargs)), Fp8Config())
    config = LoraConfig(r=4, target_modules=[], target_parameters=["v_proj.weight"])
    peft_model = get_peft_model(fp8, config)
    for layer in peft_model.base_model.model.model.layers:
        assert isinstance(layer.self_attn.v_proj, Fp8LoraLinear)
