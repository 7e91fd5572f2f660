"""R29 finding 1: the C kernel writes the weights through raw pointers, so the step did not bump
the parameter's autograd version counter: a second backward through a graph that saved the
weight silently used the updated weight, where ``torch.optim.AdamW`` (and the reference path)
make autograd raise "modified by an inplace operation". Reference: torch.optim.AdamW."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_fp8.optim import AdamWFp8

IMPLEMENTATIONS = ("cpu_kernel", "reference")


def _second_backward_error(make_opt, shape=(32, 256)) -> tuple[int, int, str | None]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(shape[1], shape[0], bias=False)
    opt = make_opt(lin.parameters())
    x = torch.randn(4, shape[1], requires_grad=True)
    y = torch.tanh(lin(x)).sum()  # the graph saves lin.weight (for x.grad)
    y.backward(retain_graph=True)
    before = lin.weight._version
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    after = lin.weight._version
    try:
        y.backward()
    except RuntimeError as err:
        return before, after, str(err)
    return before, after, None


def test_torch_adamw_makes_the_second_backward_raise():
    before, after, err = _second_backward_error(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert after > before
    assert err is not None and "modified by an inplace operation" in err


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_step_bumps_the_weight_version_like_torch(implementation):
    before, after, err = _second_backward_error(
        lambda ps: AdamWFp8(ps, lr=1e-2, implementation=implementation)
    )
    assert after > before, "the step changed the weight without bumping its version"
    assert err is not None and "modified by an inplace operation" in err


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bf16_and_non_contiguous_weights_bump_too(implementation):
    """bf16 (another kernel variant) and a transposed weight (stepped in a contiguous copy that
    is copied back) change their version as well."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(32, 256, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.randn(256, 32).t())  # non-contiguous
    opt = AdamWFp8([a, b], lr=1e-2, implementation=implementation)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    before = (a._version, b._version)
    opt.step()
    assert a._version > before[0]
    assert b._version > before[1]
