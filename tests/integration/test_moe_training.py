"""Training around FP8 MoE experts (issue 11 §3): LoRA through peft on the attention layers
of an FP8 MoE model works; peft ``target_parameters`` on the FP8 expert parameters is refused
with what to do; ``AdamWFp8`` trains 3-D expert parameters like ``torch.optim.AdamW``."""

from __future__ import annotations

import peft
import pytest
import torch

from hf_fp8 import Fp8Config, quantize_model
from hf_fp8.modules import Fp8Experts
from tests.serialization.moe_fixtures import tiny_qwen3_moe


def _fp8_moe():
    return quantize_model(tiny_qwen3_moe(), Fp8Config(), skip=["lm_head"])


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))


def test_peft_target_parameters_on_fp8_experts_is_refused_with_the_fix() -> None:
    config = peft.LoraConfig(target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(NotImplementedError, match=r"target_modules=\['q_proj'") as err:
        peft.get_peft_model(_fp8_moe(), config)
    assert "gate_up_proj" in str(err.value)


def test_lora_on_attention_of_an_fp8_moe_model_trains() -> None:
    model = _fp8_moe()
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    assert isinstance(model.base_model.model.model.layers[0].mlp.experts, Fp8Experts)
    out = model(_ids(), labels=_ids())
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "experts" in n)


@pytest.mark.parametrize("coat", [True, False], ids=["coat", "plain"])
def test_adamw_fp8_on_3d_expert_parameters_tracks_adamw(coat: bool) -> None:
    from hf_fp8.optim import AdamWFp8

    torch.manual_seed(0)
    ref = tiny_qwen3_moe().model.layers[0].mlp.experts  # high-precision experts, trained
    params = [ref.gate_up_proj, ref.down_proj]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in params]
    base = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_fp8 = AdamWFp8(ours, lr=1e-3, weight_decay=0.01, dynamic_range_expansion=coat)
    opt_ref = torch.optim.AdamW(base, lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]
        for p, q, g in zip(ours, base, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt_fp8.step()
        opt_ref.step()
    for p, q, start in zip(ours, base, params, strict=True):
        assert p.shape == start.shape and p.dim() == 3
        state = opt_fp8.state[p]
        assert any(torch.is_tensor(v) and v.element_size() == 1 for v in state.values()), state
        moved, ref_moved = p.detach() - start.detach(), q.detach() - start.detach()
        assert float((moved - ref_moved).norm() / ref_moved.norm()) < 0.1
