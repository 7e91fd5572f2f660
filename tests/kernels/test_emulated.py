"""Emulated FP8 linear: parity with torch._scaled_mm, references, paths, non-finite input."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_linear, emulated, emulated_linear, fp8_linear, quantize_activation
from hf_fp8.numerics import dequantize, quantize, quantize_weight
from tests.kernels.reference import (
    E4M3,
    assert_close_to_reference,
    fake_quant,
    reference_linear,
)

SHAPES = [(1, 32, 16), (2, 48, 32), (5, 37, 100), (33, 256, 64)]


def _operands(m, k, n, dtype, w_gran="row", bias=True):
    x = (torch.randn(m, k) * 2).to(dtype)
    w_fp8, w_scale = quantize_weight(torch.randn(n, k) * 0.05, E4M3, w_gran)
    b = (torch.randn(n) * 0.1).to(dtype) if bias else None
    return x, w_fp8, w_scale, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize(
    ("a_gran", "w_gran"),
    [("token", "row"), ("tensor", "row"), ("token", "tensor"), ("tensor", "tensor")],
)
def test_matches_cpu_scaled_mm_on_the_same_operands(dtype, m, k, n, a_gran, w_gran) -> None:
    """Same fp8 operands and scales as torch._scaled_mm: same numbers up to the
    rounding of the output (fp32 accumulation, scales on the accumulator)."""
    x, w_fp8, w_scale, bias = _operands(m, k, n, dtype, w_gran)
    a_fp8, a_scale = quantize_activation(x, E4M3, a_gran, None, 128)
    if a_gran == w_gran == "tensor":  # tensor-wise: scalar scales (oneDNN on CPU)
        sa, sb = a_scale.reshape(()), w_scale.reshape(())
    else:  # row-wise
        sa = a_scale.reshape(-1, 1).expand(m, 1).contiguous()
        sb = w_scale.reshape(1, -1).expand(1, n).contiguous()
    ref = torch._scaled_mm(a_fp8, w_fp8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    ref = (ref + bias.float()).to(dtype)
    out = fp8_linear(
        x, w_fp8, w_scale, bias, activation_granularity=a_gran, weight_granularity=w_gran,
        kernel="emulated",
    )  # fmt: skip
    assert out.dtype == dtype
    exact = reference_linear(dequantize(a_fp8, a_scale), dequantize(w_fp8, w_scale), bias)
    exact.out = ref.double()
    assert_close_to_reference(out, exact, dtype, ref_rounded=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("w_gran", ["tensor", "row", "block"])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_weight_only_matches_the_dequantized_weight(dtype, w_gran, m) -> None:
    x, w_fp8, w_scale, bias = _operands(m, 300, 130, dtype, w_gran)
    out = fp8_linear(
        x, w_fp8, w_scale, bias, activation_scheme="weight_only", weight_granularity=w_gran
    )
    w = dequantize(w_fp8, w_scale, torch.float32, w_gran)
    ref = reference_linear(x.float(), w, bias)
    assert_close_to_reference(out, ref, dtype, folded=w_gran == "block")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("scheme", "a_gran", "w_gran"),
    [
        ("dynamic", "token", "row"),
        ("dynamic", "tensor", "tensor"),
        ("dynamic", "block", "block"),
        ("dynamic", "block", "row"),
        ("dynamic", "token", "block"),
        ("static", "tensor", "row"),
    ],
)
@pytest.mark.parametrize("m", [1, 9])
def test_fp8_activations_match_the_fake_quantized_reference(dtype, scheme, a_gran, w_gran, m):
    x, w_fp8, w_scale, bias = _operands(m, 300, 70, dtype, w_gran)
    input_scale = torch.tensor([0.9 * x.float().abs().max().item() / 448])
    kwargs = {"input_scale": input_scale} if scheme == "static" else {}
    out = fp8_linear(
        x, w_fp8, w_scale, bias, activation_scheme=scheme, activation_granularity=a_gran,
        weight_granularity=w_gran, **kwargs,
    )  # fmt: skip
    if scheme == "static":
        a = dequantize(quantize_activation(x, E4M3, "tensor", input_scale, 128)[0], input_scale)
    else:
        a = fake_quant(x.float(), a_gran)
    w = dequantize(w_fp8, w_scale, torch.float32, w_gran)
    folded = "block" in (a_gran, w_gran)
    assert_close_to_reference(out, reference_linear(a, w, bias), dtype, folded=folded)


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_and_matmul_paths_agree(monkeypatch, scheme, m) -> None:
    x, w_fp8, w_scale, bias = _operands(m, 512, 96, torch.bfloat16)
    outs = {}
    for limit in (0, 64):  # the compiled emulation's GEMV and the C kernel's
        monkeypatch.setattr(emulated, "GEMV_MAX_TOKENS", limit)
        monkeypatch.setattr(cpu_linear, "GEMV_MAX_TOKENS", min(limit, 16))
        outs[limit] = fp8_linear(x, w_fp8, w_scale, bias, activation_scheme=scheme)
    # both round the same fp32-accumulated value to bf16 (the matmul path once more)
    torch.testing.assert_close(outs[0], outs[64], rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize(
    ("scheme", "a_gran", "w_gran"),
    [
        ("weight_only", None, "row"),
        ("weight_only", None, "block"),
        ("dynamic", "token", "row"),
        ("dynamic", "tensor", "row"),
        ("dynamic", "block", "block"),
        ("static", "tensor", "row"),
    ],
)
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_activations_propagate_like_a_bf16_linear(scheme, a_gran, w_gran, m, bad):
    """A bf16 nn.Linear turns a non-finite input into a non-finite output row; FP8 must
    do the same (never zeros), and leave the other tokens' outputs finite."""
    x, w_fp8, w_scale, bias = _operands(m, 256, 40, torch.bfloat16, w_gran)
    x[m - 1, 3] = bad
    kwargs = {"input_scale": torch.tensor([0.01])} if scheme == "static" else {}
    out = fp8_linear(
        x, w_fp8, w_scale, bias, activation_scheme=scheme, activation_granularity=a_gran,
        weight_granularity=w_gran, **kwargs,
    )  # fmt: skip
    plain = torch.nn.functional.linear(x, dequantize(w_fp8, w_scale, torch.bfloat16, w_gran), bias)
    assert not bool(torch.isfinite(out[m - 1]).any())
    assert not bool(torch.isfinite(plain[m - 1]).any())
    assert bool(torch.isfinite(out[: m - 1]).all())


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
@pytest.mark.parametrize("m", [1, 5])
def test_zero_inputs_and_zero_weights_give_the_bias(scheme, m) -> None:
    x, w_fp8, w_scale, bias = _operands(m, 64, 24, torch.bfloat16)
    out = fp8_linear(torch.zeros_like(x), w_fp8, w_scale, bias, activation_scheme=scheme)
    assert torch.equal(out, bias.expand(m, -1))
    z_fp8, z_scale = quantize(torch.zeros(24, 64), E4M3, "row")
    out = fp8_linear(x, z_fp8, z_scale, bias, activation_scheme=scheme)
    assert torch.equal(out, bias.expand(m, -1))


@pytest.mark.parametrize("shape", [(37,), (2, 3, 37), (0, 37), (2, 0, 37)])
def test_any_number_of_leading_dims(shape) -> None:
    x = torch.randn(shape, dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_weight(torch.randn(11, 37), E4M3)
    out = fp8_linear(x, w_fp8, w_scale)
    assert out.shape == (*shape[:-1], 11) and out.dtype == torch.bfloat16
    flat = fp8_linear(x.reshape(-1, 37), w_fp8, w_scale)
    assert torch.equal(out.reshape(-1, 11), flat)
    direct = emulated_linear(
        x, w_fp8, w_scale, None, "row", (128, 128), act_dtype=E4M3, act_granularity="row"
    )
    assert torch.equal(direct, out)


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic", "static"])
@pytest.mark.parametrize("m", [1, 6])
def test_gradients_are_straight_through(scheme, m) -> None:
    """grad_x = grad_out @ dequantize(W) (activation rounding invisible); the fp8
    weight gets no gradient even when the loader left requires_grad on."""
    x, w_fp8, w_scale, bias = _operands(m, 96, 40, torch.float32)
    w_fp8 = torch.nn.Parameter(w_fp8, requires_grad=True)
    bias.requires_grad_(True)
    x.requires_grad_(True)
    kwargs = {"input_scale": torch.tensor([0.02])} if scheme == "static" else {}
    out = fp8_linear(x, w_fp8, w_scale, bias, activation_scheme=scheme, **kwargs)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    w = dequantize(w_fp8.detach(), w_scale)
    torch.testing.assert_close(x.grad, grad_out @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad, grad_out.sum(0))
    assert w_fp8.grad is None
    with torch.no_grad():
        same = fp8_linear(x, w_fp8, w_scale, bias, activation_scheme=scheme, **kwargs)
    assert torch.equal(out.detach(), same)


def test_bf16_gradient_flows_through_3d_input() -> None:
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    w_fp8, w_scale = quantize_weight(torch.randn(32, 64), E4M3)
    fp8_linear(x, w_fp8, w_scale).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
    ref = dequantize(w_fp8, w_scale, torch.bfloat16).sum(0).expand_as(x)
    torch.testing.assert_close(x.grad, ref)


def test_never_calls_the_cpu_scaled_mm(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU hot path")

    monkeypatch.setattr(torch, "_scaled_mm", forbidden)
    for scheme, gran in [("weight_only", "row"), ("dynamic", "row"), ("dynamic", "tensor")]:
        for m in (1, 8):
            x, w_fp8, w_scale, bias = _operands(m, 64, 32, torch.bfloat16, gran)
            fp8_linear(x, w_fp8, w_scale, bias, activation_scheme=scheme, weight_granularity=gran)
    x, w_fp8, w_scale, bias = _operands(4, 64, 32, torch.bfloat16, "tensor")
    out = fp8_linear(
        x, w_fp8, w_scale, bias, activation_scheme="static", weight_granularity="tensor",
        input_scale=torch.tensor([0.01]),
    )  # fmt: skip
    assert out.shape == (4, 32) and torch.isfinite(out).all()
