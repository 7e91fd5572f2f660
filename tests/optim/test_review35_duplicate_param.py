"""R35: the same Parameter twice in one param group got "parameter 1 and parameter 1 share
memory"; it is now named as a duplicate (torch.optim deprecates duplicates), nothing changed."""

import warnings

import pytest
import torch
from torch import nn

from hf_fp8.optim import AdamWFp8


def test_a_duplicate_parameter_is_named_as_such_and_nothing_changes():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, 128))
    before = p.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.optim's own deprecation warning
        opt = AdamWFp8([p, p], lr=1e-2, min_quantize_numel=0)
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="appears more than once") as err:
        opt.step()
    assert "share memory" not in str(err.value)
    assert torch.equal(p.detach(), before)
    assert len(opt.state) == 0


def test_a_parameter_listed_once_still_steps_like_torch_adamw():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 16))
    q = nn.Parameter(p.detach().clone())
    grad = torch.randn(8, 16)
    p.grad, q.grad = grad.clone(), grad.clone()
    AdamWFp8([p], lr=1e-2, min_quantize_numel=10**9).step()  # fp32 states: torch's math
    torch.optim.AdamW([q], lr=1e-2).step()
    assert torch.equal(p.detach(), q.detach())
