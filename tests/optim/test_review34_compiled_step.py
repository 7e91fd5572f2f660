"""R34 F12: ``torch.compile(optimizer.step)`` with ``AdamWFp8``. Under ``fullgraph=True``
dynamo's error says what to do (it named ``_thread.get_ident``) and nothing moves; without
it the step runs eagerly, equal to uncompiled steps."""

from __future__ import annotations

import pytest
import torch

import hf_fp8


def _pair() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(128))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, b


def test_fullgraph_compiled_step_raises_naming_the_fix_and_moves_nothing():
    params, _ = _pair()
    before = [p.detach().clone() for p in params]
    opt = hf_fp8.AdamWFp8(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    torch._dynamo.reset()
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"AdamWFp8\.step") as err:
        step()
    assert "without fullgraph=True" in str(err.value)
    assert "get_ident" not in str(err.value)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not opt.state


def test_compiled_step_without_fullgraph_equals_eager_steps():
    compiled_params, eager_params = _pair()
    compiled_opt = hf_fp8.AdamWFp8(compiled_params, lr=1e-2)
    eager_opt = hf_fp8.AdamWFp8(eager_params, lr=1e-2)
    torch._dynamo.reset()
    step = torch.compile(compiled_opt.step, backend="eager")
    for _ in range(3):
        for p, q in zip(compiled_params, eager_params, strict=True):
            grad = torch.randn_like(p)
            p.grad, q.grad = grad.clone(), grad.clone()
        step()
        eager_opt.step()
        for p, q in zip(compiled_params, eager_params, strict=True):
            assert torch.equal(p, q)
