"""A step the C kernel refuses (out of memory) changes nothing, whatever else the step holds
(reviewer R4 finding 1): parameters on the reference path (fp16: not a kernel dtype) and other
param groups were stepped before a group's kernel launch failed, while the error said nothing
was touched, so a retry applied them twice. Reference: a twin optimizer that never failed."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from tests.optim.test_kernel_out_of_memory import failing_kernel  # noqa: F401  (fixture)


def _snapshot(opt: AdamWFp8, params) -> list:
    out = []
    for p in params:
        state = opt.state.get(p, {})
        out.append(
            (
                p.detach().clone(),
                {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()},
            )
        )
    return out


def _same(a: list, b: list) -> bool:
    for (pa, sa), (pb, sb) in zip(a, b, strict=True):
        if not torch.equal(pa, pb) or sa.keys() != sb.keys():
            return False
        for key, value in sa.items():
            if not (torch.equal(value, sb[key]) if torch.is_tensor(value) else value == sb[key]):
                return False
    return True


def _train(make, steps: int = 3) -> tuple[list, AdamWFp8, int]:
    """``steps`` steps, each retried once after a refusal that must have changed nothing."""
    params, opt = make()
    failures = 0
    for i in range(steps):
        torch.manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn_like(p)
        before = _snapshot(opt, params)
        try:
            opt.step()
        except RuntimeError as err:
            assert "out of memory" in str(err)
            assert getattr(err, "applied", False) is False
            assert _same(_snapshot(opt, params), before), "a refused step changed something"
            failures += 1
            opt.step()  # the retry
    return params, opt, failures


def _mixed_dtypes():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(256, 512, dtype=torch.float16))  # reference path
    b = torch.nn.Parameter(torch.randn(256, 512))  # C kernel, 2 threads
    c = torch.nn.Parameter(torch.randn(512))  # fp32 states
    return [a, b, c], AdamWFp8([a, b, c], lr=1e-2, implementation="auto")


def _two_groups():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(256, 512)), torch.nn.Parameter(torch.randn(256, 512))
    groups = [{"params": [a]}, {"params": [b], "weight_decay": 0.0}]
    return [a, b], AdamWFp8(groups, lr=1e-2, implementation="cpu_kernel")


@pytest.mark.parametrize("make", [_mixed_dtypes, _two_groups])
def test_a_refused_kernel_step_changes_nothing(failing_kernel, make) -> None:  # noqa: F811
    params, opt, failures = _train(make)
    assert failing_kernel and failures == 1  # the failing build ran and refused one step
    twin_params, twin, twin_failures = _train(make)  # allocations succeed from now on
    assert twin_failures == 0
    assert _same(_snapshot(opt, params), _snapshot(twin, twin_params))


def test_a_kernel_refusal_in_a_later_group_changes_nothing() -> None:
    """implementation="cpu_kernel" refuses group 1's float64 gradient (refused while the step
    is planned, no longer by a separate pre-check): group 0 and every counter stay as they were."""
    params, opt = _two_groups()
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    params[0].grad = torch.randn_like(params[0])
    params[1].grad_dtype = None  # torch allows a float64 gradient on an fp32 weight then
    params[1].grad = torch.randn_like(params[1], dtype=torch.float64)
    before = _snapshot(opt, params)
    with pytest.raises(RuntimeError, match="nothing was updated"):
        opt.step()
    assert _same(_snapshot(opt, params), before)
