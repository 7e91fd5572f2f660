"""A step that is refused changes nothing (reviewer R1 finding 7).

``torch.optim.AdamW`` raises on a sparse gradient before it updates any parameter. AdamWFp8
checked inside its loop: parameters before the bad one were already stepped (weights moved on
the torch path, step counters advanced on the C kernel path). After a refused step the
weights, states and step counters must equal those of a twin optimizer that never saw it,
and the next step must be bit-identical to the twin's.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8


def _params(dtype2: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(64, 128)),  # quantized
        torch.nn.Parameter(torch.randn(64)),  # fp32 states
        torch.nn.Parameter(torch.randn(32, 256).to(dtype2)),  # quantized
    ]


def _grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _assert_same(opt_a: AdamWFp8, params_a, opt_b: AdamWFp8, params_b) -> None:
    assert len(opt_a.state) == len(opt_b.state)  # no entries for parameters not stepped
    for a, b in zip(params_a, params_b, strict=True):
        assert torch.equal(a.detach(), b.detach())
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def _twins(groups, **options):
    """Two identical optimizers over two copies of the parameters (one group per list)."""
    out = []
    for _ in range(2):
        copies = [[torch.nn.Parameter(p.detach().clone()) for p in g] for g in groups]
        opt = AdamWFp8([{"params": g} for g in copies], lr=1e-2, **options)
        out.append((opt, [p for g in copies for p in g]))
    return out


def _step(opt, params, seed):
    for p, g in zip(params, _grads(params, seed), strict=True):
        p.grad = g
    opt.step()


def _sparse_grad(p: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor([[1]], torch.ones(1, *p.shape[1:]), p.shape)


@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize("stepped_before", [False, True])
def test_sparse_gradient_late_in_the_group_changes_nothing(implementation, stepped_before):
    embedding = torch.nn.Parameter(torch.randn(10, 4))
    (opt, params), (twin, twin_params) = _twins(
        [[*_params(), embedding]], **{"implementation": implementation}
    )
    if stepped_before:  # states exist already
        _step(opt, params, 1)
        _step(twin, twin_params, 1)
    for p, g in zip(params[:3], _grads(params[:3], 2), strict=True):
        p.grad = g
    params[3].grad = _sparse_grad(params[3])
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    _assert_same(opt, params, twin, twin_params)
    for p in params + twin_params:  # the next good step is the twin's, bit for bit
        p.grad = None
    _step(opt, params[:3], 3)
    _step(twin, twin_params[:3], 3)
    _assert_same(opt, params, twin, twin_params)


def test_sparse_gradient_in_a_later_group_leaves_the_first_group_alone():
    embedding = torch.nn.Parameter(torch.randn(10, 4))
    (opt, params), (twin, twin_params) = _twins([_params(), [embedding]])
    for p, g in zip(params[:3], _grads(params[:3], 2), strict=True):
        p.grad = g
    params[3].grad = _sparse_grad(params[3])
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    _assert_same(opt, params, twin, twin_params)


def test_explicit_kernel_refusing_a_later_parameter_changes_nothing():
    """implementation="cpu_kernel" refuses a float64 weight (the C kernel is fp32 / bf16): the
    fp32 weights before it are not stepped either."""
    (opt, params), (twin, twin_params) = _twins(
        [_params(torch.float64)], implementation="cpu_kernel"
    )
    for p, g in zip(params, _grads(params, 2), strict=True):
        p.grad = g
    with pytest.raises(RuntimeError, match="cpu_kernel"):
        opt.step()
    _assert_same(opt, params, twin, twin_params)
