"""Reviewer R14 finding 1 (defence in depth): a finite activation whose quotient by a small
static scale overflows float32 (``|x| > 3.4e38 * scale``) saturated to NaN, so one large
value made a layer's (and the model's) outputs NaN. A finite input now saturates at
``±fp8_max`` in every path (numerics, the C kernel on each of its code paths, Fp8Linear,
Fp8Experts); only a NaN / inf input gives NaN.

References are fp32 torch math written here: ``clamp(x / scale, ±max)`` cast to fp8 (torch's
cast of a clamped value), times the scale, against the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.kernels import cpu_kernel, emulated
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics import dequantize, quantize_with_scale
from tests.modules.moe_zoo import build_tiny, experts_classes, routed_inputs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {"e4m3": E4M3, "e5m2": E5M2}
BIG = 1e38  # finite in fp32 and bf16; over 3.4e38 * scale for every scale below 0.34
C_PATHS = [p for p in cpu_kernel.supported_paths() if cpu_kernel.library(p) is not None]


def _q(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """Reference fp8 values in fp32: divide, saturate, cast."""
    m = torch.finfo(fmt).max
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(-m, m).to(fmt).float()


def _fq(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """Reference fake-quantization: the fp8 values times the scale."""
    return _q(x, scale, fmt) * scale


def _inputs(dtype: torch.dtype, tokens: int = 5) -> torch.Tensor:
    x = torch.randn(tokens, 64)
    x[0, 3], x[1, 7], x[2, 0], x[4, 63], x[-1, 9] = BIG, -BIG, 3e37, -2e38, BIG
    return x.to(dtype)


@pytest.mark.parametrize("fmt", sorted(FMT))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_finite_values_saturate_and_only_non_finite_inputs_give_nan(fmt, dtype, granularity):
    f8 = FMT[fmt]
    top = torch.finfo(f8).max
    x = torch.tensor([[BIG, -BIG, 1.0, 0.0, float("nan"), float("inf"), -float("inf"), -1e-3]])
    x = x.to(dtype)
    scale = torch.tensor([1e-20]) if granularity == "tensor" else torch.tensor([[1e-20, 1e-20]])
    got = quantize_with_scale(x, scale, f8, granularity, (1, 4)).float()
    want = torch.tensor([[top, -top, top, 0.0, float("nan"), float("nan"), float("nan"), -top]])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not C_PATHS, reason="no C kernel builds here")
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("fmt", sorted(FMT))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_saturates_an_overflowing_quotient_like_the_reference(path, fmt, x_dtype):
    """Every width of the C loops (64 columns: the 32 / 16-lane vector loops and the scalar
    tail): a finite value saturates, NaN / inf stay NaN, the rest rounds as the reference."""
    f8 = FMT[fmt]
    x = torch.randn(3, 67) * 0.1
    x[0, :67:5] = BIG
    x[1, 1:67:3] = -BIG
    x[2, 66], x[2, 65], x[2, 2] = float("nan"), float("inf"), -float("inf")
    x = x.to(x_dtype)
    scale = 0.05
    for out_dtype in (torch.float32, torch.bfloat16):
        for post in (True, False):
            got, _ = cpu_kernel.quantize_activation(
                x, torch.tensor([scale]), f8, "tensor", 1, out_dtype, post, path
            )
            want = _q(x, scale, f8) if post else _fq(x, scale, f8)
            want[2, 2] = want[2, 65] = float("nan")
            torch.testing.assert_close(got.float(), want.to(out_dtype).float(), rtol=0,
                                       atol=0, equal_nan=True)  # fmt: skip
            emu, _ = emulated._fake_quant_act(
                x, torch.tensor([scale]), act_dtype=f8, gran="tensor", bk=1,
                out_dtype=out_dtype, post=post,
            )  # fmt: skip
            torch.testing.assert_close(got, emu, rtol=0, atol=0, equal_nan=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kernel_env", ["off", *C_PATHS])
@pytest.mark.parametrize("fmt", sorted(FMT))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 40])  # the GEMV; the (fused) matmul past 16 tokens
def test_fp8_linear_with_a_huge_activation_matches_the_dequantized_reference(
    kernel_env, fmt, dtype, tokens, monkeypatch
):
    monkeypatch.setenv(cpu_kernel.ENV, kernel_env)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, bias=True).to(dtype)
    layer = Fp8Linear.from_linear(
        linear, Fp8Config("static", fp8_format=fmt, activation_scale=0.05)
    )
    x = _inputs(dtype, tokens)
    with torch.no_grad():
        got = layer(x)
    w = dequantize(layer.weight, layer.weight_scale, torch.float32)
    want = _fq(x, 0.05, FMT[fmt]).double() @ w.double().T + layer.bias.double()
    assert bool(got.isfinite().all())
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_inductor_compiled_emulation_saturates_too(dtype, monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV, "off")
    monkeypatch.setenv("HF_FP8_COMPILE", "1")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, bias=False).to(dtype)
    layer = Fp8Linear.from_linear(linear, Fp8Config("static", activation_scale=0.05))
    x = _inputs(dtype)
    with torch.no_grad():
        got = layer(x)
    w = dequantize(layer.weight, layer.weight_scale, torch.float32)
    want = _fq(x, 0.05, E4M3).double() @ w.double().T
    assert bool(got.isfinite().all())
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_linear_at_the_smallest_accepted_scale_stays_finite(dtype):
    """The smallest scale a config accepts (AMAX_EPS / fp8_max, what calibration stores for
    an amax of 1e-12): every nonzero input saturates, no NaN, in every compute dtype."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 8, bias=False).to(dtype)
    scale = float(torch.tensor(1e-12) / 448.0)
    layer = Fp8Linear.from_linear(linear, Fp8Config("static", activation_scale=scale))
    x = torch.randn(4, 64)
    x[0, 0] = 6e4 if dtype == torch.float16 else 1e30
    x = x.to(dtype)
    with torch.no_grad():
        got = layer(x)
    w = dequantize(layer.weight, layer.weight_scale, torch.float32)
    want = (x.float().sign() * 448.0 * scale).double() @ w.double().T
    assert bool(got.isfinite().all())
    if dtype == torch.float16:  # it cannot hold these ~1e-13 outputs: they round to zero
        assert torch.equal(got, want.to(dtype))
    else:
        assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


QWEN3 = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")


@pytest.mark.parametrize("kernel_env", ["off", *C_PATHS[:1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_with_a_huge_activation_match_the_dequantized_reference(
    kernel_env, dtype, monkeypatch
):
    monkeypatch.setenv(cpu_kernel.ENV, kernel_env)
    source = build_tiny(QWEN3, dtype=dtype)
    fp8 = Fp8Experts.from_experts(source, Fp8Config("static", activation_scale=0.02))
    layout = fp8.layout
    x, index, weights = routed_inputs(layout.hidden_size, layout.num_experts, tokens=9)
    x[0, 1], x[4, 0], x[8, -1] = BIG, -BIG, 3e37
    x = x.to(dtype)
    with torch.no_grad():
        got = fp8(x, index, weights.to(dtype))
    want = torch.zeros(x.shape, dtype=torch.float64)
    for e in index.unique().tolist():
        token, pos = (index == e).nonzero(as_tuple=True)
        h = x[token]
        for proj in layout.projections:
            w = dequantize(getattr(fp8, proj)[e], getattr(fp8, f"{proj}_weight_scale")[e])
            h = _fq(h, 0.02, E4M3).double() @ w.double().T
            if proj != "down_proj":
                gate, up = h.chunk(2, dim=-1)
                h = source.act_fn(gate.to(dtype)).double() * up
        want.index_add_(0, token, h * weights[token, pos, None].double())
    assert bool(got.isfinite().all())
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 3e-2)
