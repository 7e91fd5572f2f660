"""R24 F3: empty linear layers, as nn.Linear supports them.

``nn.Linear(k, 0)`` (an empty projection) crashed in every C CPU kernel ('fp8_gemv failed
with code -1' up to the GEMV limit, 'torch.cat(): expected a non-empty list' above), and
``quantize_model`` on ``nn.Linear(0, n)`` raised a raw ``IndexError`` from ``amax``. They now
convert and compute what nn.Linear computes: ``[..., 0]``, and zeros + bias. Reference:
the nn.Linear the layer was made from (exact here: no product to round).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from hf_fp8.kernels import cpu_kernel
from hf_fp8.numerics import amax

PATHS = [p for p in cpu_kernel.supported_paths() if cpu_kernel.library(p) is not None]
CONFIGS = [
    ("weight_only", "row"),
    ("weight_only", "tensor"),
    ("dynamic", "row"),
    ("dynamic", "block"),
]


@pytest.fixture(params=[*PATHS, "off"])
def route(request, monkeypatch) -> str:
    monkeypatch.setenv(cpu_kernel.ENV, request.param)
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    return request.param


@pytest.mark.parametrize(("scheme", "wg"), CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "n"), [(5, 0), (0, 16)])
def test_empty_layers_compute_what_nn_linear_computes(route, scheme, wg, dtype, k, n) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(k, n).to(dtype)
    with torch.no_grad():
        linear.bias.normal_()
    model = quantize_model(
        nn.Sequential(copy.deepcopy(linear)), Fp8Config(scheme, weight_granularity=wg)
    )
    layer = model[0]
    assert isinstance(layer, Fp8Linear) and layer.weight.shape == (n, k)
    for m in (1, 13, 40):  # the GEMV, above the AVX2 bf16 limit, the matmul
        x = torch.randn(2, m, k).to(dtype)
        with torch.no_grad():
            out, ref = layer(x), linear(x)
        assert out.shape == ref.shape == (2, m, n) and out.dtype == dtype
        assert torch.equal(out, ref)


@pytest.mark.parametrize(("k", "n"), [(5, 0), (0, 16)])
def test_empty_layers_train_like_nn_linear(k, n) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(k, n)
    layer = Fp8Linear.from_linear(copy.deepcopy(linear), Fp8Config("dynamic"))
    x = torch.randn(3, k, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    layer(x).sum().backward()
    linear(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(layer.bias.grad, linear.bias.grad)


@pytest.mark.parametrize(
    ("gran", "shape", "want"),
    [("tensor", (4, 0), (1,)), ("row", (4, 0), (4, 1)), ("block", (4, 0), (1, 0))],
)
def test_amax_of_an_empty_tensor_is_zero_with_the_scale_shape(gran, shape, want) -> None:
    got = amax(torch.empty(shape), gran, (128, 128))
    assert tuple(got.shape) == want and bool((got == 0).all())


@pytest.mark.parametrize("lead", [(3,), (2, 4)])
def test_functional_fp8_linear_with_zero_inputs_gives_the_bias(route, lead) -> None:
    """The functional ``fp8_linear`` with K = 0 (``reshape(-1, 0)`` was ambiguous and raised):
    the product is empty, so the output is the bias, as ``F.linear`` gives."""
    from hf_fp8.kernels.fp8_linear import fp8_linear

    x = torch.randn(*lead, 0)
    w8 = torch.zeros(6, 0, dtype=torch.float8_e4m3fn)
    bias = torch.randn(6)
    out = fp8_linear(x, w8, torch.ones(6, 1), bias)
    want = torch.nn.functional.linear(x, torch.zeros(6, 0), bias)
    assert out.shape == (*lead, 6)
    assert torch.equal(out, want)
