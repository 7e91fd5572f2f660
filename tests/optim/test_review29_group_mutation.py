"""R29 finding 3: a format option changed in a live param group (``optimizer.param_groups[0][
"sqrt_second_moment"] = True`` after some steps) was not checked against the stored moments:
the stored v was read as its root (weights 36x off), fp8 codes were decoded as log codes, a
dropped expansion was ignored, a new group size gave a broadcast error. Every implementation
now refuses the step with an error naming the option and the fix, before anything changes.
Reference: the fp32 moments (a group without stored moments takes any option)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_fp8.optim import AdamWFp8

MUTATIONS = [
    ({}, {"sqrt_second_moment": True}),
    ({}, {"fp8_format": "e5m2"}),
    ({}, {"dynamic_range_expansion": False}),
    ({}, {"moment_format": "log"}),
    ({}, {"moment_format": "auto"}),  # resolves to "log" here
    ({}, {"group_size": 64}),
    ({"moment_format": "log"}, {"moment_format": "fp8"}),
    ({"moment_format": "log"}, {"group_size": 32}),
    ({"dynamic_range_expansion": False}, {"dynamic_range_expansion": True}),
]


def _make(implementation, **options):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(32, 256) * 0.1)
    b = torch.nn.Parameter(torch.randn(32))  # fp32 state
    return [p, b], AdamWFp8([p, b], lr=1e-3, implementation=implementation, **options)


def _steps(params, opt, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for q in params:
            q.grad = torch.randn(q.shape, generator=gen) * 1e-3
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()


def _snapshot(opt, params):
    return [(q.detach().clone(), {k: v.clone() for k, v in opt.state[q].items()}) for q in params]


@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize(("options", "mutation"), MUTATIONS)
def test_changing_a_format_option_of_a_live_group_is_refused(implementation, options, mutation):
    params, opt = _make(implementation, **options)
    _steps(params, opt, 2)
    m0, v0 = (t.clone() for t in opt.moments(params[0]))
    before = _snapshot(opt, params)
    old = {k: opt.param_groups[0][k] for k in mutation}
    opt.param_groups[0].update(mutation)
    option = next(iter(mutation))
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    with pytest.raises(ValueError, match=option) as info:
        opt.step()
    message = str(info.value)
    assert "param_groups[0]" in message and "torch_state_dict" in message
    for q, (w, st) in zip(params, before, strict=True):
        assert torch.equal(q.detach(), w)
        assert all(torch.equal(opt.state[q][k], v) for k, v in st.items())
    # set back, the run continues on the moments it stored
    opt.param_groups[0].update(old)
    m1, v1 = opt.moments(params[0])
    assert torch.equal(m0, m1) and torch.equal(v0, v1)
    opt.step()


@pytest.mark.parametrize("implementation", ["auto", "reference"])
def test_a_group_without_stored_moments_takes_new_options(implementation):
    """Before the first step, or once the group's states are dropped, a changed option is the
    format the moments start in: the same run as an optimizer built with it."""
    params, opt = _make(implementation)
    opt.param_groups[0]["group_size"] = 64
    twin_params, twin = _make(implementation, group_size=64)
    _steps(params, opt, 2)
    _steps(twin_params, twin, 2)
    assert opt.state[params[0]]["exp_avg_scale"].shape == (32, 4)
    for q, r in zip(params, twin_params, strict=True):
        assert torch.equal(q.detach(), r.detach())
    for q in params:  # restart the moments: any format again
        opt.state.pop(q)
    opt.param_groups[0]["sqrt_second_moment"] = True
    _steps(params, opt, 1)
    m, v = opt.moments(params[0])
    g = params[0].grad.float()  # first step from zero moments: m = (1-b1) g, v = (1-b2) g²
    assert float((m - 0.1 * g).norm() / (0.1 * g).norm()) < 0.05
    assert float((v - 0.001 * g * g).norm() / (0.001 * g * g).norm()) < 0.1


def test_other_options_of_a_live_group_still_change():
    params, opt = _make("auto")
    _steps(params, opt, 1)
    opt.param_groups[0].update(lr=2e-3, min_quantize_numel=10**9, stochastic_rounding=False)
    opt.param_groups[0]["seed"] = 5
    _steps(params, opt, 1)
    assert float(opt.state[params[0]]["step"]) == 2.0
