"""Reviewer R31 F7, F11, F12: the FP8 linear's autograd.Function was old-style (no
``setup_context``: torch.func ``grad`` / ``jacrev`` refused it), ``vmap`` handed a functorch
BatchedTensor to the C kernel ("Cannot access data pointer"), the backward was
``once_differentiable`` (double backward refused), and it saved the fp8 codes even when only
the bias needed a gradient (inference tensors cannot be saved). The reference is the
dequantized float model (weight-only in fp32 computes exactly ``x @ W_deq.T + b``), in
float64 where it matters; the fp8 weights are frozen, so the reference's weights are too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import grad, jacrev, vmap

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.kernels import fp8_linear


def _pair(scheme: str = "weight_only", dtype=torch.float32):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16)).to(dtype)
    fp8 = copy.deepcopy(net)
    hf_fp8.quantize_model(fp8, Fp8Config(scheme))
    reference = copy.deepcopy(fp8)
    for i in (0, 2):  # the dequantized float model, weights frozen as the fp8 ones are
        reference[i] = reference[i].dequantize().to(torch.float64)
        reference[i].weight.requires_grad_(False)
    return fp8, reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm())


def test_func_grad_equals_the_dequantized_gradient() -> None:
    fp8, reference = _pair()
    x = torch.randn(5, 64)
    got = grad(lambda i: fp8(i).pow(2).sum())(x)
    xr = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(reference(xr).pow(2).sum(), xr)
    assert got.shape == x.shape and _rel(got, want) < 1e-5


def test_jacrev_equals_the_dequantized_jacobian() -> None:
    fp8, reference = _pair()
    x = torch.randn(2, 64)
    got = jacrev(lambda i: fp8(i).sum(0))(x)
    want = torch.autograd.functional.jacobian(lambda i: reference(i).sum(0), x.double())
    assert got.shape == (16, 2, 64) and _rel(got, want) < 1e-5


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
def test_vmap_equals_one_call_per_sample(scheme: str) -> None:
    fp8, reference = _pair(scheme)
    x = torch.randn(5, 1, 64)
    with torch.no_grad():
        got = vmap(fp8)(x)
        per_sample = torch.stack([fp8(x[i]) for i in range(5)])
        want = reference(x.double())
    assert got.shape == (5, 1, 16)
    # same fp8 operands (per-token scales are per sample here), fp32 reassociation only
    torch.testing.assert_close(got, per_sample, rtol=1e-5, atol=1e-5)
    assert _rel(got, want) < (1e-5 if scheme == "weight_only" else 0.05)


def test_per_sample_gradients_with_vmap_of_grad() -> None:
    fp8, reference = _pair()
    x = torch.randn(4, 64)
    got = vmap(grad(lambda i: fp8(i.unsqueeze(0)).pow(2).sum()))(x)
    xr = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(reference(xr).pow(2).sum(), xr)  # rows are independent
    assert got.shape == x.shape and _rel(got, want) < 1e-5


def test_double_backward_equals_the_dequantized_model() -> None:
    fp8, reference = _pair()
    x = torch.randn(3, 64)
    results = []
    for model, dtype in ((fp8, torch.float32), (reference, torch.float64)):
        xi = x.detach().to(dtype).requires_grad_(True)
        (g,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()  # a gradient penalty
        results.append((xi.grad, model[0].bias.grad))
        model.zero_grad()
    (gx, gb), (wx, wb) = results
    assert gx is not None and gb is not None
    assert _rel(gx, wx) < 1e-5 and _rel(gb, wb) < 1e-5


def test_gradcheck_and_gradgradcheck_in_float64() -> None:
    torch.manual_seed(0)
    layer = hf_fp8.Fp8Linear.from_linear(nn.Linear(8, 4).double(), Fp8Config("weight_only"))
    bias = layer.bias.detach().clone().requires_grad_(True)

    def f(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, b, plan=layer._plan)

    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    # the forward accumulates float64 inputs in fp32 (~1e-7): a large step, exact for a
    # function linear in x and b, keeps the finite differences above that rounding
    tol = dict(eps=1e-2, atol=1e-4, rtol=1e-3)
    assert torch.autograd.gradcheck(f, (x, bias), **tol)
    assert torch.autograd.gradgradcheck(f, (x, bias), **tol)


@pytest.mark.parametrize("x_grad", [False, True])
def test_inference_tensor_weights_run_in_grad_mode(x_grad: bool) -> None:
    """Weights made under inference_mode (a model loaded there), then a forward and backward
    in grad mode: the bias (and input) get their gradients."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    reference = copy.deepcopy(linear).double()
    with torch.inference_mode():
        layer = hf_fp8.Fp8Linear.from_linear(linear, Fp8Config("weight_only"))
    assert layer.weight.is_inference()
    with torch.no_grad():
        reference.weight.copy_(layer.dequantize_weight().double())
    bias = layer.bias.detach().clone().requires_grad_(True)  # a trainable bias
    layer.bias = nn.Parameter(bias)
    x = torch.randn(4, 16, requires_grad=x_grad)
    out = layer(x)
    out.pow(2).sum().backward()
    xr = x.detach().double().requires_grad_(x_grad)
    want = reference(xr)
    want.pow(2).sum().backward()
    assert _rel(out, want) < 1e-6
    assert _rel(layer.bias.grad, reference.bias.grad) < 1e-5
    if x_grad:
        assert _rel(x.grad, xr.grad) < 1e-5
