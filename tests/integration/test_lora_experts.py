"""peft LoRA aimed at FP8 MoE experts (``target_parameters``, or ``target_modules`` naming the
experts module) is refused at ``get_peft_model`` with the fix (it was accepted and failed only
in the first forward); on experts kept in high precision it trains as without FP8."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_fp8 import Fp8Config, quantize_model
from hf_fp8.modules import Fp8Experts, Fp8Linear
from tests.serialization.moe_fixtures import tiny_qwen3_moe


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "config",
    [
        dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]),
        dict(target_modules=["experts"]),
    ],
    ids=["target_parameters", "target_modules"],
)
def test_lora_on_fp8_experts_is_refused_at_get_peft_model(config):
    model = quantize_model(tiny_qwen3_moe(), Fp8Config(), skip=["lm_head"])
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp\.experts") as err:
        get_peft_model(model, LoraConfig(r=4, **config))
    message = str(err.value)
    assert "Fp8Experts" in message and "target_modules=['q_proj'" in message
    assert "modules_to_not_convert=['experts']" in message


def test_lora_on_high_precision_experts_of_an_fp8_model_trains_as_without_fp8():
    """Experts kept in high precision (attention FP8, weight-only) take target_parameters
    LoRA; the trained adapters match the same run on the dequantized model."""
    fp8 = quantize_model(tiny_qwen3_moe(), Fp8Config("weight_only"), skip=["lm_head", "experts"])
    assert isinstance(fp8.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert not any(isinstance(m, Fp8Experts) for m in fp8.modules())
    dense = copy.deepcopy(fp8).dequantize()
    trained = []
    for model in (fp8, dense):
        config = LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
        torch.manual_seed(1)
        peft_model = get_peft_model(model, config)
        params = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
        assert params and all("lora_" in n for n in params)
        opt = torch.optim.AdamW(params.values(), lr=1e-2)
        for _ in range(3):
            peft_model(_ids(), labels=_ids()).loss.backward()
            opt.step()
            opt.zero_grad()
        trained.append({n: p.detach().clone() for n, p in params.items()})
    assert trained[0].keys() == trained[1].keys()
    for name, value in trained[0].items():
        assert "lora_B" not in name or value.abs().sum() > 0  # B moved off its zero init
        torch.testing.assert_close(value, trained[1][name], rtol=1e-3, atol=1e-5)
