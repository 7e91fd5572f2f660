"""Loaded param groups keep every saved key, like ``torch.optim`` (reviewer R1 finding 6).

LR schedulers write ``initial_lr`` into the groups; a scheduler created with ``last_epoch``
after loading needs it. ``torch.optim.AdamW``'s own flags (``foreach``, ``fused``, ...) are
not AdamWFp8 options and are dropped; ``torch.optim.Adam``'s L2 weight decay cannot be
honoured and is refused. The reference is ``torch.optim.AdamW`` loading the same state.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_fp8.optim import AdamWFp8

# torch.optim.AdamW's own group flags, read from torch (not copied from the code under test):
# its defaults minus AdamW's hyper-parameters that AdamWFp8 shares.
TORCH_FLAGS = tuple(
    sorted(
        set(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults)
        - {"lr", "betas", "eps", "weight_decay"}
    )
)


def _scheduled_state(cls: type) -> tuple[torch.nn.Parameter, dict]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = cls([p], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
        sched.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["my_tag"] = "kept"  # any key a user or library added
    return p, sd


def test_scheduler_resumes_after_loading_like_torch_adamw():
    lrs = {}
    for cls in (torch.optim.AdamW, AdamWFp8):
        p, sd = _scheduled_state(cls)
        opt = cls([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
        opt.load_state_dict(sd)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e, last_epoch=2)
        lrs[cls] = (opt.param_groups[0]["lr"], opt.param_groups[0]["initial_lr"])
        assert opt.param_groups[0]["my_tag"] == "kept"
    assert lrs[AdamWFp8] == lrs[torch.optim.AdamW] == (1e-3 * 0.5**3, 1e-3)  # epoch 3


def test_torch_adamw_state_keeps_its_extra_keys_and_drops_torch_flags():
    p, sd = _scheduled_state(torch.optim.AdamW)
    assert all(flag in sd["param_groups"][0] for flag in TORCH_FLAGS)
    opt = AdamWFp8([torch.nn.Parameter(p.detach().clone())], lr=1e-3, group_size=64)
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert not any(flag in group for flag in TORCH_FLAGS)
    assert group["initial_lr"] == 1e-3 and group["my_tag"] == "kept"
    assert group["lr"] == sd["param_groups"][0]["lr"]  # saved hyper-parameters win
    assert group["group_size"] == 64  # options the torch state lacks stay this optimizer's
    saved_again = opt.state_dict()["param_groups"][0]
    assert saved_again["initial_lr"] == 1e-3


def _adam_state(weight_decay: float) -> tuple[torch.nn.Parameter, dict]:
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = torch.optim.Adam([p], lr=1e-3, weight_decay=weight_decay)
    p.grad = torch.randn_like(p)
    opt.step()
    return p, opt.state_dict()


def test_torch_adam_l2_weight_decay_is_refused():
    """torch.optim.Adam's weight decay is L2 on the gradient; AdamWFp8 decays decoupled."""
    p, sd = _adam_state(0.1)
    opt = AdamWFp8([torch.nn.Parameter(p.detach().clone())])
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        opt.load_state_dict(sd)
    assert not opt.state


def test_torch_adam_without_weight_decay_loads():
    p, sd = _adam_state(0.0)
    opt = AdamWFp8([torch.nn.Parameter(p.detach().clone())])
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["weight_decay"] == 0.0
    assert "decoupled_weight_decay" not in opt.param_groups[0]
