"""R38 F2: ``Fp8Linear`` follows ``torch.autocast`` as ``nn.Linear`` does.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` ``nn.Linear`` runs in bf16 and returns
bf16; an FP8 layer of a float32 model ignored autocast and computed (and returned) float32,
3x slower, while its internal fp32 matmuls were silently turned into bf16 ones by autocast.
Now the autocast dtype is the compute dtype: the output is what the layer gives for the
input cast to that dtype outside autocast, bit for bit, and its dtype is ``nn.Linear``'s
under the same autocast. References: the dequantized ``nn.Linear`` under autocast (dtype,
values within bf16 rounding, gradients) and the float64 dequantized product.
"""

from __future__ import annotations

import pytest
import torch

import hf_fp8
from hf_fp8.modules.fp8_linear import Fp8Linear

SCHEMES = {
    "dynamic": (("dynamic",), {}),
    "static": (("static",), {"activation_scale": 0.02}),
    "weight_only": (("weight_only",), {}),
}


def _layers(scheme: str) -> tuple[Fp8Linear, torch.nn.Linear]:
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(128, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 128, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(48, generator=gen) * 0.1)
    args, kwargs = SCHEMES[scheme]
    layer = Fp8Linear.from_linear(lin, hf_fp8.Fp8Config(*args, **kwargs))
    return layer, layer.dequantize()  # both float32


def _x(m: int, requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(2, m, 128, generator=torch.Generator().manual_seed(1))
    return x.requires_grad_(requires_grad)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("m", [3, 24])  # the GEMV and the many-token route
def test_autocast_bf16_computes_and_returns_bf16(scheme, m) -> None:
    layer, deq = _layers(scheme)
    x = _x(m)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
            ref_dtype = deq(x).dtype
        outside = layer(x.to(torch.bfloat16))
    assert ref_dtype == torch.bfloat16
    assert out.dtype == ref_dtype
    assert torch.equal(out, outside)
    # the float64 product of the bf16 input's fake-quantized activation and the dequantized
    # weight: within bf16 rounding (and, quantized, fp8's) of it
    w64 = deq.weight.double()
    ref = x.to(torch.bfloat16).double() @ w64.T + deq.bias.double()
    terms = x.double().abs() @ w64.abs().T + deq.bias.double().abs()
    tol = 2.0**-7 if scheme == "weight_only" else 2.0**-3
    assert bool(((out.double() - ref).abs() <= tol * terms).all())


@pytest.mark.parametrize("scheme", ["dynamic", "weight_only"])
def test_autocast_backward_matches_nn_linear(scheme) -> None:
    layer, deq = _layers(scheme)
    x1, x2 = _x(24, True), _x(24, True)
    grad = torch.randn(2, 24, 48, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x1)
        ref = deq(x2)
    assert out.dtype == ref.dtype == torch.bfloat16
    out.backward(grad.to(out.dtype))
    ref.backward(grad.to(ref.dtype))
    assert x1.grad.dtype == x2.grad.dtype == torch.float32
    # straight-through: grad_out @ W in bf16 as nn.Linear's backward under autocast
    assert torch.allclose(x1.grad, x2.grad, rtol=2.0**-6, atol=2.0**-6)
    assert layer.bias.grad is not None and layer.bias.grad.dtype == torch.float32
    assert torch.allclose(layer.bias.grad, deq.bias.grad, rtol=2.0**-6, atol=2.0**-6)


def test_autocast_disabled_changes_nothing() -> None:
    layer, _ = _layers("dynamic")
    x = _x(24)
    with torch.no_grad():
        plain = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            off = layer(x)
    assert off.dtype == torch.float32 and torch.equal(off, plain)


def test_autocast_compiles_without_graph_breaks() -> None:
    layer, _ = _layers("dynamic")
    x = _x(24)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x)
        want = layer(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [3, 24])
def test_autocast_leaves_the_inner_fp32_products_alone(m) -> None:
    """A bf16 model under bf16 autocast: the same bits as without autocast, also where the
    layer multiplies in fp32 inside (the overflow redo of a 3e37 token on the GEMV takes an
    fp32 matmul, which autocast would turn into a bf16 one)."""
    layer, _ = _layers("weight_only")
    layer = layer.to(torch.bfloat16)
    x = _x(m).to(torch.bfloat16)
    x[0, 1] = torch.where(x[0, 1] >= 0, 3e37, -3e37).to(torch.bfloat16)
    with torch.no_grad():
        plain = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer(x)
    assert bool(plain.isfinite().all())
    assert got.dtype == torch.bfloat16 and torch.equal(got, plain)
