"""R29 finding 5: ``pickle.loads(pickle.dumps(optimizer))`` failed for fp8 moments (torch's
plain pickling cannot rebuild float8 storages: "UntypedStorage has no attribute dtype"), while
torch.save and copy.deepcopy worked. The optimizer now pickles its fp8 codes as uint8 bytes
with their dtype. Reference: the optimizer that was not pickled, stepped the same way."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from hf_fp8.optim import AdamWFp8


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _make(**options):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 256)), torch.nn.Parameter(torch.randn(32))]
    opt = AdamWFp8(params, lr=1e-2, **options)
    for i in range(2):
        _grads(params, i)
        opt.step()
    return params, opt


ROUND_TRIPS = {
    "pickle": lambda o: pickle.loads(pickle.dumps(o)),
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("trip", sorted(ROUND_TRIPS))
@pytest.mark.parametrize(
    "options",
    [{}, {"fp8_format": "e5m2"}, {"dynamic_range_expansion": False}, {"moment_format": "log"}],
    ids=["e4m3", "e5m2", "plain", "log"],
)
def test_pickled_optimizer_resumes_bit_identically(trip, options):
    params, opt = _make(**options)
    copy_opt = ROUND_TRIPS[trip](opt)
    copies = [p for g in copy_opt.param_groups for p in g["params"]]
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p.detach(), q.detach())
        st, sq = opt.state[p], copy_opt.state[q]
        assert st.keys() == sq.keys()
        for key, value in st.items():
            assert sq[key].dtype == value.dtype
            bits = (lambda t: t.view(torch.uint8)) if value.element_size() == 1 else (lambda t: t)
            assert torch.equal(bits(sq[key]), bits(value)), key
    for i in range(2, 4):
        _grads(params, i)
        _grads(copies, i)
        opt.step()
        copy_opt.step()
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p.detach(), q.detach())
    # the original is untouched by pickling and the copy keeps the format checks
    copy_opt.param_groups[0]["group_size"] = 64
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['group_size'\]"):
        copy_opt.step()
