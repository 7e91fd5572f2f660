"""calibrate() on static Fp8Experts: one scale per expert and projection, from its routed rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from tests.modules.moe_zoo import build_tiny, experts_classes

QWEN3 = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")


class _Moe(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x, index, weights):
        return self.experts(x, index, weights)


def _inputs(experts: Fp8Experts, tokens: int = 12, unused: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = experts.layout.hidden_size
    x = torch.randn(tokens, hidden, generator=gen) * 2
    logits = torch.randn(tokens, experts.num_experts, generator=gen)
    if unused is not None:
        logits[:, unused] = -1e9  # no token reaches this expert
    weights, index = torch.topk(logits.softmax(-1), 2, dim=-1)
    return x, index, weights


def test_each_expert_gets_the_scale_of_its_routed_rows():
    fp8 = Fp8Experts.from_experts(build_tiny(QWEN3), Fp8Config("static"))
    model = _Moe(fp8)
    batch = _inputs(fp8)
    scales = hf_fp8.calibrate(model, [batch], progress=False)
    x, index, _ = batch
    w_gate_up = fp8.dequantize_weight("gate_up_proj", torch.float32)  # [E, 2I, H]
    for e in range(fp8.num_experts):
        rows = x[(index == e).any(dim=-1)]
        # gate_up input: the hidden states routed to e (reference from the routing itself)
        expected_up = float(rows.abs().max()) / 448
        assert scales[f"experts.gate_up_proj[{e}]"] == pytest.approx(expected_up, rel=1e-6)
        assert float(fp8.gate_up_proj_input_scale[e]) == pytest.approx(expected_up, rel=1e-6)
        # down input: act(gate) * up of those rows, with the source class's own gate
        h = QWEN3._apply_gate(fp8, rows @ w_gate_up[e].T)
        expected_down = float(h.abs().max()) / 448
        assert scales[f"experts.down_proj[{e}]"] == pytest.approx(expected_down, rel=1e-4)
    assert fp8.recipe.is_static and "_project" not in fp8.__dict__  # restored
    out = model(*batch)
    assert torch.isfinite(out).all()


def test_an_expert_no_token_reached_falls_back_with_the_warning():
    fp8 = Fp8Experts.from_experts(build_tiny(QWEN3), Fp8Config("static"))
    last = fp8.num_experts - 1
    with pytest.warns(UserWarning, match=rf"saw no tokens: .*experts\.gate_up_proj\[{last}\]"):
        scales = hf_fp8.calibrate(_Moe(fp8), [_inputs(fp8, unused=last)], progress=False)
    calibrated = [v for k, v in scales.items() if not k.endswith(f"[{last}]")]
    assert scales[f"experts.gate_up_proj[{last}]"] == max(calibrated)
    assert scales[f"experts.down_proj[{last}]"] == max(calibrated)
