"""R43 note: the "loaded state replaces your option" warning of AdamWFp8 (R37 finding 2) was
lost after ``copy.deepcopy`` or pickling the optimizer, since ``__getstate__`` did not carry
what the user had set. Reference: the fresh optimizer, which warns naming the option."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from hf_fp8.optim import AdamWFp8


def _saved_with_seed_0() -> dict:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 256))]
    opt = AdamWFp8(params, seed=0)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("how", ["fresh", "deepcopy", "pickle"])
def test_a_copied_optimizer_still_warns_when_a_loaded_state_replaces_an_option(how):
    saved = _saved_with_seed_0()
    opt = AdamWFp8([torch.nn.Parameter(torch.randn(64, 256))], seed=3)
    if how == "deepcopy":
        opt = copy.deepcopy(opt)
    elif how == "pickle":
        opt = pickle.loads(pickle.dumps(opt))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved)
    replaced = [str(w.message) for w in caught if "replace yours" in str(w.message)]
    assert len(replaced) == 1 and "seed=0 (you set 3)" in replaced[0], replaced
    assert opt.param_groups[0]["seed"] == 0  # the loaded value is kept, as torch does


def test_a_copied_optimizer_with_defaults_does_not_warn():
    saved = _saved_with_seed_0()
    opt = copy.deepcopy(AdamWFp8([torch.nn.Parameter(torch.randn(64, 256))]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved)
    assert not [w for w in caught if "replace yours" in str(w.message)]
