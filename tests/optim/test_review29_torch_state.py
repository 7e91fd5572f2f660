"""R29 finding 6: an AdamWFp8 state loaded into ``torch.optim.AdamW`` is accepted by torch's
``load_state_dict`` and fails at the first step with a bare ``KeyError: 'exp_avg'`` (e.g.
Trainer runs resumed with ``optim="adamw_torch"``). ``AdamWFp8.torch_state_dict()`` returns a
state torch.optim.AdamW loads and steps: fp32 ``exp_avg`` / ``exp_avg_sq`` decoded from the
stored codes, ``step`` as torch stores it, torch AdamW's param-group flags. Reference: fp32
AdamW math on the decoded moments."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fp8.optim import AdamWFp8

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8
FORMATS = [{}, {"moment_format": "log"}, {"dynamic_range_expansion": False, "group_size": 64}]


def _trained(**options):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 256)), torch.nn.Parameter(torch.randn(32))]
    groups = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}]
    opt = AdamWFp8(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **options)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 0.1
        opt.step()
    return params, opt


@pytest.mark.parametrize("options", FORMATS, ids=["fp8", "log", "plain-gs64"])
def test_torch_adamw_steps_from_the_decoded_moments(options):
    params, opt = _trained(**options)
    decoded = [tuple(t.clone() for t in opt.moments(p)) for p in params]
    sd = opt.torch_state_dict()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(
        [{"params": twins[:1]}, {"params": twins[1:], "weight_decay": 0.0}], lr=1.0
    )
    ref.load_state_dict(sd)
    assert ref.param_groups[0]["lr"] == LR and ref.param_groups[1]["weight_decay"] == 0.0
    assert ref.param_groups[0]["decoupled_weight_decay"] is True
    grads = [torch.randn_like(p) * 0.1 for p in params]
    for q, g in zip(twins, grads, strict=True):
        q.grad = g.clone()
    ref.step()
    for p, q, g, (m, v), wd in zip(params, twins, grads, decoded, (WD, 0.0), strict=True):
        t = 4  # three steps taken, this is the fourth
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        denom = v.sqrt() / math.sqrt(1 - BETAS[1] ** t) + EPS
        want = p.detach() * (1 - LR * wd) - LR / (1 - BETAS[0] ** t) * m / denom
        assert float(ref.state[q]["step"]) == t
        assert torch.allclose(q.detach(), want, rtol=0, atol=1e-6)


def test_torch_state_moves_moments_to_another_format():
    """The fix a refused live-format change names: the fp32 moments load into an AdamWFp8 of
    another format (converted to its codes)."""
    params, opt = _trained()
    decoded = [opt.moments(p) for p in params]
    new = AdamWFp8(
        [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}],
        lr=LR,
        moment_format="log",
        group_size=64,
    )
    with pytest.warns(RuntimeWarning, match="converted"):
        new.load_state_dict(opt.torch_state_dict())
    assert new.state[params[0]]["exp_avg_fp8"].dtype == torch.int8
    assert new.state[params[0]]["exp_avg_scale"].shape == (32, 4)
    for p, (m, v) in zip(params, decoded, strict=True):
        m2, v2 = new.moments(p)
        assert float((m2 - m).norm() / m.norm()) < 0.05
        assert float((v2 - v).norm() / v.norm()) < 0.05
        assert float(new.state[p]["step"]) == 3.0


def test_torch_state_dict_leaves_the_optimizer_alone():
    params, opt = _trained()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    sd = opt.torch_state_dict()
    sd["state"][0]["exp_avg"].add_(1.0)
    sd["state"][0]["step"].add_(1.0)
    for k, v in before.items():
        now = opt.state[params[0]][k]
        if v.element_size() == 1:
            now, v = now.view(torch.uint8), v.view(torch.uint8)
        assert torch.equal(now, v), k
    assert set(sd["param_groups"][0]) >= {"lr", "betas", "eps", "weight_decay", "params"}
    assert "group_size" not in sd["param_groups"][0]
