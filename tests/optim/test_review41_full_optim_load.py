"""R41 findings 4, 10, 11 in one process: ``set_full_optimizer_state_dict_fp8`` decides by the
dict's content. An AdamWFp8 state into a plain ``torch.optim.AdamW`` is refused before
anything is installed (it was installed as unscaled moments, then ``KeyError: 'exp_avg'`` at
the step); a dict that lost the state of every parameter is refused like one that lost one
(it loaded silently, every moment restarting); an id-keyed ``optimizer.state_dict()`` is named
as such with the way to load it (it was called a dict 'saved from another model')."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_fp8
from hf_fp8.fsdp import full_optimizer_state_dict_fp8, set_full_optimizer_state_dict_fp8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))


def _stepped(opt_cls, model, **kw):
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    model(torch.randn(4, 64, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def test_adamw_fp8_state_into_plain_adamw_is_refused_before_installing():
    model = _model()
    full = full_optimizer_state_dict_fp8(model, _stepped(hf_fp8.AdamWFp8, model))
    assert full["state"]["0.weight"]["exp_avg_fp8"].dtype == torch.float8_e4m3fn
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="AdamWFp8") as info:
        set_full_optimizer_state_dict_fp8(model, plain, full)
    assert "torch_state_dict()" in str(info.value)
    assert len(plain.state) == 0  # nothing installed
    # without the format key the fp8 codes alone are enough
    groups = [
        {k: v for k, v in g.items() if k != "hf_fp8_state_format"} for g in full["param_groups"]
    ]
    with pytest.raises(ValueError, match="AdamWFp8"):
        set_full_optimizer_state_dict_fp8(model, plain, {**full, "param_groups": groups})
    assert len(plain.state) == 0
    # the route it names: AdamWFp8 in one process, torch_state_dict(), then torch's AdamW
    # steps like a torch AdamW whose moments are the decoded ones (reference: those moments)
    fp8 = hf_fp8.AdamWFp8(model.parameters(), lr=1e-2)
    set_full_optimizer_state_dict_fp8(model, fp8, full)
    converted = fp8.torch_state_dict()
    plain.load_state_dict(converted)
    for pid, p in enumerate(model.parameters()):
        assert plain.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(plain.state[p]["exp_avg"], converted["state"][pid]["exp_avg"])


def test_plain_adamw_full_state_still_loads_into_plain_adamw():
    """Reference for the refusal above: torch's own state goes through unchanged."""
    model = _model()
    saved = _stepped(torch.optim.AdamW, model)
    full = full_optimizer_state_dict_fp8(model, saved)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_full_optimizer_state_dict_fp8(model, plain, full)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(plain.state[p][key], saved.state[p][key])


def test_a_dict_without_any_state_is_refused_like_one_without_some():
    model = _model()
    full = full_optimizer_state_dict_fp8(model, _stepped(hf_fp8.AdamWFp8, model))
    lost_one = {k: v for k, v in full["state"].items() if k != "1.bias"}
    for state, match in ((lost_one, "no state for"), ({}, "no state for any")):
        opt = hf_fp8.AdamWFp8(model.parameters(), lr=1e-2)
        with pytest.raises(ValueError, match=match) as info:
            set_full_optimizer_state_dict_fp8(
                model, opt, {"state": state, "param_groups": full["param_groups"]}
            )
        assert "strict=False" in str(info.value)
        assert len(opt.state) == 0
    # strict=False restarts every moment, as asked: the state of a fresh optimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    opt = hf_fp8.AdamWFp8(model.parameters(), lr=1e-2)
    set_full_optimizer_state_dict_fp8(
        model,
        opt,
        {"state": {}, "param_groups": full["param_groups"]},
        StateDictOptions(full_state_dict=True, strict=False),
    )
    assert len(opt.state) == 0


def test_an_id_keyed_state_dict_is_named_with_the_way_to_load_it():
    model = _model()
    saved = _stepped(hf_fp8.AdamWFp8, model)
    opt = hf_fp8.AdamWFp8(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="id-keyed") as info:
        set_full_optimizer_state_dict_fp8(model, opt, saved.state_dict())
    message = str(info.value)
    assert "another model" not in message, message
    assert "full_optimizer_state_dict_fp8" in message and "load_state_dict" in message
    assert len(opt.state) == 0
    # the way it names: the id-keyed dict loads in one process with load_state_dict
    opt.load_state_dict(saved.state_dict())
    for p in model.parameters():
        a, b = opt.state[p], saved.state[p]
        assert set(a) == set(b)
        for key in a:
            x, y = a[key], b[key]
            if x.element_size() == 1:
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            assert torch.equal(x, y), key


def test_an_empty_state_is_legitimate_only_for_groups_that_never_stepped():
    """Param groups recording ``step`` (optimizers that count steps per group): an empty
    state with step 0 is a fresh optimizer's (loads, nothing installed, as a fresh one);
    with step 3 it lost every moment (refused)."""
    model = _model()
    full = full_optimizer_state_dict_fp8(model, _stepped(hf_fp8.AdamWFp8, model))
    fresh = hf_fp8.AdamWFp8(model.parameters(), lr=1e-2)
    groups = [{**full["param_groups"][0], "step": 0}]
    set_full_optimizer_state_dict_fp8(model, fresh, {"state": {}, "param_groups": groups})
    assert len(fresh.state) == 0
    stepped = hf_fp8.AdamWFp8(model.parameters(), lr=1e-2)
    groups = [{**full["param_groups"][0], "step": 3}]
    with pytest.raises(ValueError, match="no state for any"):
        set_full_optimizer_state_dict_fp8(model, stepped, {"state": {}, "param_groups": groups})
    assert len(stepped.state) == 0
