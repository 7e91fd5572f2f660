"""R38 F1: a NaN / inf (or overflowing) token must not change the other tokens' outputs.

Per-token activation scales (and static or weight-only layers) keep each token's output
independent of the others, as in the dequantized ``nn.Linear``. The overflow redo (a
non-finite output of a post-scaled product is computed again with the scales folded into the
operands, R24 F2) used to redo the whole batch, so one bad token moved the other tokens'
outputs by up to a bf16 ulp (R38: 768 of 1472 elements on the fused AVX-512 BF16 GEMM). Now
only the rows that need it take the folded product. References: the same batch with the bad
token finite (the other rows must keep their bits), the batch without the bad token (where
the route's rows do not depend on the token count), and the float64 product of the
fake-quantized activation and the dequantized weight for the bad token's own row.
"""

from __future__ import annotations

import pytest
import torch

import hf_fp8
from hf_fp8.kernels import cpu_kernel
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.numerics import dequantize, quantize, quantize_with_scale
from tests.kernels.test_cpu_kernel import PATHS

K, N, BAD = 256, 64, 5
SCHEMES = {  # name -> (Fp8Config args, kwargs)
    "dynamic_token": (("dynamic",), {}),
    "dynamic_tensor": (("dynamic",), {"activation_granularity": "tensor"}),
    "static": (("static",), {"activation_scale": 0.01}),
    "weight_only": (("weight_only",), {}),
}
FUSED = "avx512bf16" in PATHS


@pytest.fixture(params=["fused", "tiled", "via_fp32", "off"])
def route(request, monkeypatch) -> str:
    """The many-token routes: the fused AVX-512 BF16 GEMM, decode + torch's bf16 matmul,
    the same bf16 operands as an fp32 matmul (AVX2 CPUs), and the emulation (kernels off)."""
    if request.param != "off" and PATHS == ["unavailable"]:
        pytest.skip("no C kernel builds here")
    if request.param == "fused" and not FUSED:
        pytest.skip("the fused matmul runs on the avx512bf16 path only")
    if request.param == "off":
        monkeypatch.setenv(cpu_kernel.ENV, "off")
    else:
        monkeypatch.setenv(cpu_kernel.ENV, "avx512bf16" if FUSED else PATHS[0])
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", request.param == "fused")
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", request.param == "via_fp32")
    return request.param


def _layer(scheme: str) -> Fp8Linear:
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(N, generator=gen) * 0.1)
    args, kwargs = SCHEMES[scheme]
    return Fp8Linear.from_linear(lin.to(torch.bfloat16), hf_fp8.Fp8Config(*args, **kwargs))


def _reference(layer: Fp8Linear, x: torch.Tensor, scheme: str):
    """(float64 output, float64 sum of |terms|): the fake-quantized activation (numerics)
    times the dequantized weight, plus the bias."""
    x32, fmt = x.float(), layer.weight.dtype
    if scheme == "weight_only":
        a = x32.double()
    elif scheme == "static":
        q = quantize_with_scale(x32, layer.input_scale.float(), fmt)
        a = q.double() * layer.input_scale.double()
    else:
        gran = "row" if scheme == "dynamic_token" else "tensor"
        q, s = quantize(x32, fmt, gran)
        a = dequantize(q, s, torch.float64, gran)
    w = layer.weight.double() * layer.weight_scale.double()
    b = layer.bias.double()
    return a @ w.T + b, a.abs().nan_to_num(0.0) @ w.abs().T + b.abs()


def _batch(m: int) -> torch.Tensor:
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(3))
    x[BAD] *= 0.5  # the bad token never holds the batch amax (per-tensor scale)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("kind", ["nan", "inf", "huge"])
def test_a_bad_token_leaves_the_other_tokens_bits(route, scheme, kind) -> None:
    if kind == "huge" and scheme != "weight_only":
        pytest.skip("fp8 activations cannot overflow the unscaled sums")
    layer = _layer(scheme)
    x = _batch(24)
    y = x.clone()
    if kind == "huge":  # 3e37 times unscaled codes (up to 448) overflows fp32
        y[BAD] = torch.where(x[BAD] >= 0, 3e37, -3e37).to(torch.bfloat16)
    else:
        y[BAD, 7] = float(kind)
    others = [i for i in range(24) if i != BAD]
    with torch.no_grad():
        clean = layer(x)
        out = layer(y)
        without = layer(x[others])  # 23 tokens: the same route
    changed = out[others] != clean[others]
    assert not bool(changed.any()), (
        f"{route}: token {BAD}'s {kind} changed {int(changed.sum())} outputs of the others"
    )
    if route in ("fused", "off"):  # rows independent of the token count there
        assert torch.equal(out[others], without)
    ref, terms = _reference(layer, y, scheme)
    if kind == "huge":  # finite and close to float64: the folded product
        assert bool(ref[BAD].isfinite().all()) and float(ref[BAD].abs().max()) > 1e30
        assert bool(out[BAD].isfinite().all()), out[BAD]
        err = (out[BAD].double() - ref[BAD]).abs()
        assert bool((err <= 2.0**-7 * (ref[BAD].abs() + terms[BAD])).all())
    else:  # NaN where float64 is NaN, the same +-inf elsewhere
        got, want = out[BAD].double(), ref[BAD]
        assert not bool(want.isfinite().any())
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_clean_rows_stay_close_to_float64(route, scheme) -> None:
    """The rows the bad token leaves alone are the post-scaled product, within the bf16 bound
    of the float64 reference (the sanity check of the bit comparison above)."""
    layer = _layer(scheme)
    y = _batch(24)
    y[BAD, 7] = float("nan")
    with torch.no_grad():
        out = layer(y)
    ref, terms = _reference(layer, y, scheme)
    others = [i for i in range(24) if i != BAD]
    err = (out[others].double() - ref[others]).abs()
    assert bool((err <= 2.0**-7 * (ref[others].abs() + terms[others])).all())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_overflowing_token_leaves_the_other_tokens_on_the_gemv(monkeypatch, native, dtype):
    """Up to the GEMV limit (the C GEMV, or the emulation's with the kernels off) the redo of
    a 3e37 token (weight-only: unscaled codes overflow its fp32 sums) is its row's alone."""
    if native and PATHS == ["unavailable"]:
        pytest.skip("no C kernel builds here")
    monkeypatch.setenv(cpu_kernel.ENV, PATHS[0] if native else "off")
    layer = _layer("weight_only").to(dtype)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = x.clone()
    y[1] = torch.where(x[1] >= 0, 3e37, -3e37).to(dtype)
    with torch.no_grad():
        clean, out = layer(x), layer(y)
    assert torch.equal(out[[0, 2]], clean[[0, 2]])
    ref, terms = _reference(layer, y, "weight_only")
    assert bool(out[1].isfinite().all()) and float(ref[1].abs().max()) > 1e30
    r = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-16
    assert bool(((out[1].double() - ref[1]).abs() <= r * (ref[1].abs() + terms[1])).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_rows_is_isfinite_all(dtype) -> None:
    """The fast row check of the redo (a row sum first) against torch's ``isfinite``: NaN,
    +-inf, +inf next to -inf, and finite rows whose sum overflows (not flagged)."""
    big = torch.finfo(dtype).max
    t = torch.randn(9, 40)
    t[1, 3] = float("nan")
    t[2, 0] = float("inf")
    t[3, 5], t[3, 6] = float("inf"), float("-inf")
    t[4, :] = big  # finite, the fp32 sum overflows for float32 and bfloat16
    t[5, 39] = float("-inf")
    t = t.to(dtype)
    assert torch.equal(cpu_kernel.finite_rows(t), t.isfinite().all(1))
