"""The AdamWFp8 state dict records its format version (reviewer R20 F5 note).

Past releases changed the rounding of the stored codes, so a state is bit-exact only with the
hf_fp8 that wrote it; a state written by a newer hf_fp8 (a newer format) was accepted silently.
Now every saved param group holds ``hf_fp8_state_format``; a newer one is refused before
anything changes, a state without it (older hf_fp8, torch AdamW) loads as before.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from tests.optim.test_state_dict import make, roundtrip, train

KEY = "hf_fp8_state_format"


def _resumed(params, sd) -> tuple[list, AdamWFp8]:
    """A fresh optimizer over copies of ``params`` (the model's checkpoint) loading ``sd``."""
    params2, opt2 = make()
    with torch.no_grad():
        for p2, p in zip(params2, params, strict=True):
            p2.copy_(p)
    opt2.load_state_dict(sd)
    return params2, opt2


def _snapshot(opt, params) -> list:
    return [
        (
            p.detach().clone(),
            {k: v.clone() for k, v in opt.state.get(p, {}).items()},
        )
        for p in params
    ]


def _same(a: list, b: list) -> bool:
    return all(
        torch.equal(pa, pb)
        and sa.keys() == sb.keys()
        and all(torch.equal(v, sb[k]) for k, v in sa.items())
        for (pa, sa), (pb, sb) in zip(a, b, strict=True)
    )


def test_every_saved_group_records_the_format_and_survives_torch_save() -> None:
    params, opt = make()
    train(params, opt, range(2))
    sd = roundtrip(opt.state_dict())
    assert [g[KEY] for g in sd["param_groups"]] == [1, 1]
    assert all(KEY not in g for g in opt.param_groups)  # not a hyper-parameter
    params2, opt2 = _resumed(params, sd)
    assert all(KEY not in g for g in opt2.param_groups)
    assert [g[KEY] for g in opt2.state_dict()["param_groups"]] == [1, 1]
    train(params, opt, range(2, 4))
    train(params2, opt2, range(2, 4))
    assert _same(_snapshot(opt, params), _snapshot(opt2, params2))


@pytest.mark.parametrize("newer", [2, 99])
def test_a_newer_format_is_refused_before_anything_changes(newer) -> None:
    params, opt = make()
    train(params, opt, range(2))
    sd = opt.state_dict()
    sd["param_groups"][1][KEY] = newer
    params2, opt2 = make()
    train(params2, opt2, range(1))
    before, groups = _snapshot(opt2, params2), [dict(g) for g in opt2.param_groups]
    with pytest.raises(ValueError, match=rf"format {newer}.*newer hf_fp8"):
        opt2.load_state_dict(sd)
    assert _same(_snapshot(opt2, params2), before)
    assert [dict(g) for g in opt2.param_groups] == groups


@pytest.mark.parametrize("bad", ["1", 1.0, True, None, -1])
def test_a_malformed_format_is_refused(bad) -> None:
    params, opt = make()
    train(params, opt, range(1))
    sd = opt.state_dict()
    sd["param_groups"][0][KEY] = bad
    with pytest.raises(ValueError, match=KEY):
        make()[1].load_state_dict(sd)


def test_a_state_without_the_format_loads_as_the_current_one() -> None:
    """An older hf_fp8's state (no key): the resume is bit-identical, as before."""
    params, opt = make()
    train(params, opt, range(2))
    sd = roundtrip(opt.state_dict())  # a copy: the state tensors are the optimizer's own
    for g in sd["param_groups"]:
        g.pop(KEY)
    params2, opt2 = _resumed(params, sd)
    train(params, opt, range(2, 4))
    train(params2, opt2, range(2, 4))
    assert _same(_snapshot(opt, params), _snapshot(opt2, params2))


def test_torch_adamw_loads_the_state_dict_shape() -> None:
    """torch.optim.AdamW keeps unknown group keys: the format key does not break its loader."""
    params = [torch.nn.Parameter(torch.randn(8))]
    opt = AdamWFp8(params, lr=1e-2)
    params[0].grad = torch.randn(8)
    opt.step()
    sd = opt.state_dict()
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))], lr=1e-2)
    torch_opt.load_state_dict(sd)
    assert torch_opt.param_groups[0][KEY] == 1
