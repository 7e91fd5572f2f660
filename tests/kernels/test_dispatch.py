"""Kernel choice: auto / scaled_mm / emulated, the errors that name the fix, padding."""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_fp8.kernels import (
    KERNELS,
    check_kernel,
    fp8_linear,
    has_fp8_gemm,
    quantize_activation,
    scaled_mm_linear,
    unsupported_reason,
)
from hf_fp8.numerics import dequantize, quantize_weight
from tests.kernels.reference import E4M3, assert_close_to_reference, reference_linear

# the package exports functions named like these modules: import the modules themselves
fp8_linear_module = importlib.import_module("hf_fp8.kernels.fp8_linear")
scaled_mm_module = importlib.import_module("hf_fp8.kernels.scaled_mm")
E5M2 = torch.float8_e5m2
CPU = torch.device("cpu")


def _weight(n=24, k=40, gran="row", dtype=E4M3):
    return quantize_weight(torch.randn(n, k) * 0.05, dtype, gran)


def test_kernel_names() -> None:
    for word in KERNELS:  # every word of the recipe's vocabulary is accepted as it is
        assert check_kernel(word) == word
    with pytest.raises(ValueError, match=r"kernel='cutlass'.*'auto', 'scaled_mm', 'emulated'"):
        check_kernel("cutlass")
    w_fp8, w_scale = _weight()
    with pytest.raises(ValueError, match="kernel="):
        fp8_linear(torch.randn(2, 40), w_fp8, w_scale, kernel="triton")


def test_a_prebuilt_plan_is_what_fp8_linear_runs() -> None:
    """fp8_linear(plan=...) (what Fp8Linear passes) equals the word form, and the plan comes
    from the recipe: token activations run the numerics' row layout."""
    from hf_fp8.kernels import LinearPlan
    from hf_fp8.recipe import Fp8Recipe

    plan = LinearPlan.from_recipe(Fp8Recipe.resolve("dynamic", kernel="emulated"))
    assert plan.act_granularity == "row" and plan.act_dtype == E4M3 and not plan.static
    w_fp8, w_scale = _weight()
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    by_words = fp8_linear(x, w_fp8, w_scale, activation_granularity="token", kernel="emulated")
    assert torch.equal(fp8_linear(x, w_fp8, w_scale, plan=plan), by_words)
    static = LinearPlan.from_recipe(Fp8Recipe.resolve("static"))
    with pytest.raises(RuntimeError, match="no input_scale"):
        fp8_linear(x, w_fp8, w_scale, plan=static)


def test_no_fp8_gemm_on_this_cpu() -> None:
    assert not has_fp8_gemm("cpu")
    if not torch.cuda.is_available():
        assert not has_fp8_gemm()


def test_scaled_mm_where_it_cannot_run_names_the_fix() -> None:
    w_fp8, w_scale = _weight()
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"compute capability >= 8\.9.*kernel='auto'"):
        fp8_linear(x, w_fp8, w_scale, kernel="scaled_mm")
    with pytest.raises(ValueError, match=r"weight_only.*kernel='auto'"):
        fp8_linear(x, w_fp8, w_scale, activation_scheme="weight_only", kernel="scaled_mm")


def test_bad_scheme_and_missing_static_scale() -> None:
    w_fp8, w_scale = _weight()
    x = torch.randn(3, 40)
    with pytest.raises(ValueError, match=r"activation_scheme='int8'.*'dynamic', 'static'"):
        fp8_linear(x, w_fp8, w_scale, activation_scheme="int8")
    with pytest.raises(RuntimeError, match=r"no input_scale.*calibrate.*activation_scale"):
        fp8_linear(x, w_fp8, w_scale, activation_scheme="static")
    with pytest.raises(ValueError, match="activation_granularity='channel'"):
        fp8_linear(x, w_fp8, w_scale, activation_granularity="channel")
    with pytest.raises(ValueError, match="activation granularity='row'"):
        quantize_activation(x, E4M3, "row", None, 128)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ((torch.bfloat16, E4M3, E4M3, "row", "row"), None),
        ((torch.bfloat16, E4M3, E4M3, "tensor", "tensor"), None),
        ((torch.float32, E4M3, E4M3, "tensor", "tensor"), None),
        ((torch.float16, E4M3, E4M3, "tensor", "tensor"), None),
        ((torch.bfloat16, E5M2, E4M3, "row", "row"), None),
        ((torch.float16, E4M3, E4M3, "row", "row"), "only writes bfloat16"),
        ((torch.float32, E4M3, E4M3, "tensor", "row"), "only writes bfloat16"),
        ((torch.bfloat16, E5M2, E5M2, "row", "row"), "two e5m2"),
        ((torch.bfloat16, E4M3, E5M2, "tensor", "row"), "e4m3 weight"),
        ((torch.bfloat16, E4M3, E5M2, "tensor", "tensor"), None),
        ((torch.bfloat16, E4M3, E4M3, "block", "block"), "block-wise"),
        ((torch.bfloat16, E4M3, E4M3, "row", "block"), "block-wise"),
    ],
)
def test_unsupported_reason_on_an_fp8_gpu(monkeypatch, args, reason) -> None:
    monkeypatch.setattr(scaled_mm_module, "has_fp8_gemm", lambda device: True)
    got = unsupported_reason(CPU, *args)
    assert got is None if reason is None else reason in got


def test_unsupported_reason_without_an_fp8_gpu() -> None:
    reason = unsupported_reason(CPU, torch.bfloat16, E4M3, E4M3, "row", "row")
    assert "compute capability >= 8.9" in reason and "cpu" in reason


@pytest.fixture
def fake_fp8_gpu(monkeypatch):
    """Pretend the CPU is an FP8 GPU: ``auto`` then runs torch._scaled_mm (which exists on
    CPU), exercising the dispatch, padding and scale layout of the GPU path here."""
    monkeypatch.setattr(scaled_mm_module, "has_fp8_gemm", lambda device: True)
    calls = []
    real = fp8_linear_module.scaled_mm_linear

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_linear_module, "scaled_mm_linear", spy)
    return calls


@pytest.mark.parametrize(
    ("scheme", "a_gran", "w_gran", "dtype", "expected"),
    [
        ("dynamic", "token", "row", torch.bfloat16, "scaled_mm"),
        ("dynamic", "tensor", "tensor", torch.float32, "scaled_mm"),
        ("static", "tensor", "tensor", torch.float16, "scaled_mm"),
        ("static", "tensor", "row", torch.bfloat16, "scaled_mm"),
        ("dynamic", "token", "row", torch.float16, "emulated"),
        ("dynamic", "block", "block", torch.bfloat16, "emulated"),
        ("weight_only", None, "row", torch.bfloat16, "emulated"),
    ],
)
@pytest.mark.parametrize(("m", "k", "n"), [(3, 40, 24), (5, 37, 100), (16, 64, 32)])
def test_auto_uses_scaled_mm_for_the_scalings_it_supports(
    fake_fp8_gpu, scheme, a_gran, w_gran, dtype, expected, m, k, n
) -> None:
    x = torch.randn(m, k).to(dtype)
    w_fp8, w_scale = _weight(n, k, w_gran)
    bias = torch.randn(n).to(dtype)
    input_scale = torch.tensor([x.float().abs().max().item() / 448])
    kwargs = dict(
        activation_scheme=scheme, activation_granularity=a_gran, weight_granularity=w_gran,
        input_scale=input_scale if scheme == "static" else None,
    )  # fmt: skip
    out = fp8_linear(x, w_fp8, w_scale, bias, **kwargs)
    assert len(fake_fp8_gpu) == (expected == "scaled_mm")
    assert out.shape == (m, n) and out.dtype == dtype
    emulated = fp8_linear(x, w_fp8, w_scale, bias, kernel="emulated", **kwargs)
    assert len(fake_fp8_gpu) == (expected == "scaled_mm")
    torch.testing.assert_close(out, emulated, rtol=2**-6, atol=2e-2)
    if expected == "scaled_mm":
        forced = fp8_linear(x, w_fp8, w_scale, bias, kernel="scaled_mm", **kwargs)
        assert torch.equal(forced, out)
    else:
        with pytest.raises((RuntimeError, ValueError), match="kernel='auto'"):
            fp8_linear(x, w_fp8, w_scale, bias, kernel="scaled_mm", **kwargs)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (3, 37, 100), (7, 100, 37), (4, 32, 48)])
@pytest.mark.parametrize("rowwise", [True, False])
def test_scaled_mm_linear_pads_odd_dimensions(m, k, n, rowwise) -> None:
    """K and N are zero-padded to multiples of 16 (the GPU kernel's rule); the result is
    the unpadded product."""
    x = torch.randn(m, k, dtype=torch.bfloat16)
    gran = "row" if rowwise else "tensor"
    w_fp8, w_scale = _weight(n, k, gran)
    a_fp8, a_scale = quantize_activation(x, E4M3, "token" if rowwise else "tensor", None, 128)
    bias = torch.randn(n, dtype=torch.bfloat16)
    out = scaled_mm_linear(a_fp8, a_scale, w_fp8, w_scale, bias, torch.bfloat16)
    ref = reference_linear(dequantize(a_fp8, a_scale), dequantize(w_fp8, w_scale), bias)
    assert_close_to_reference(out, ref, torch.bfloat16)


def test_gradients_through_the_scaled_mm_path(fake_fp8_gpu) -> None:
    x = torch.randn(2, 3, 40, requires_grad=True)
    w_fp8, w_scale = _weight(24, 40, "tensor")
    bias = torch.randn(24, requires_grad=True)
    out = fp8_linear(
        x, w_fp8, w_scale, bias, activation_granularity="tensor", weight_granularity="tensor"
    )
    assert len(fake_fp8_gpu) == 1
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    w = dequantize(w_fp8, w_scale)
    torch.testing.assert_close(x.grad, grad_out @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad, grad_out.sum((0, 1)))


@pytest.mark.parametrize(
    ("scheme", "a_gran", "w_gran"),
    [("dynamic", "token", "row"), ("static", "tensor", "tensor"), ("dynamic", "tensor", "row")],
)
def test_scaled_mm_path_under_torch_compile(fake_fp8_gpu, scheme, a_gran, w_gran) -> None:
    """The GPU branch traces in one graph with a dynamic token count (the user's
    torch.compile; the pretend-GPU capability check is a plain Python constant here)."""
    w_fp8, w_scale = _weight(37, 40, w_gran)
    bias = torch.randn(37, dtype=torch.bfloat16)
    kwargs = dict(
        activation_scheme=scheme, activation_granularity=a_gran, weight_granularity=w_gran,
        input_scale=torch.tensor([0.01]) if scheme == "static" else None,
    )  # fmt: skip

    def fn(x):
        return fp8_linear(x, w_fp8, w_scale, bias, **kwargs)

    torch._dynamo.reset()
    try:
        compiled_fn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
        for m in (3, 17, 64):
            x = torch.randn(2, m, 40, dtype=torch.bfloat16)
            with torch.no_grad():
                torch.testing.assert_close(compiled_fn(x), fn(x), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
    assert fake_fp8_gpu


@pytest.mark.cuda
@pytest.mark.skipif(not has_fp8_gemm(), reason="needs a CUDA GPU with compute capability >= 8.9")
@pytest.mark.parametrize(
    ("scheme", "a_gran", "w_gran"),
    [("dynamic", "token", "row"), ("dynamic", "tensor", "tensor"), ("static", "tensor", "row")],
)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (33, 100, 37), (256, 2048, 512)])
def test_cuda_scaled_mm_matches_the_emulation(compiled, scheme, a_gran, w_gran, m, k, n) -> None:
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_weight(torch.randn(n, k, device=dev) * 0.05, E4M3, w_gran)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    input_scale = (x.float().abs().amax() / 448).reshape(1) if scheme == "static" else None
    kwargs = dict(
        activation_scheme=scheme, activation_granularity=a_gran, weight_granularity=w_gran,
        input_scale=input_scale,
    )  # fmt: skip
    out = fp8_linear(x, w_fp8, w_scale, bias, kernel="scaled_mm", **kwargs)
    assert torch.equal(out, fp8_linear(x, w_fp8, w_scale, bias, **kwargs))  # auto = scaled_mm
    emulated = fp8_linear(x, w_fp8, w_scale, bias, kernel="emulated", **kwargs)
    a_fp8, a_scale = quantize_activation(x, E4M3, a_gran, input_scale, 128)
    ref = reference_linear(dequantize(a_fp8, a_scale), dequantize(w_fp8, w_scale), bias)
    assert_close_to_reference(out.cpu(), _cpu(ref), torch.bfloat16, fp8_tensor_cores=True)
    assert_close_to_reference(emulated.cpu(), _cpu(ref), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not has_fp8_gemm(), reason="needs a CUDA GPU with compute capability >= 8.9")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_tensorwise_output_dtypes_and_transposed_weight(dtype) -> None:
    """Tensor-wise runs for every output dtype (fp32: bias added after the gemm); a
    weight quantized through its transpose (GPT-2 Conv1D) is not column-major as is."""
    dev = torch.device("cuda")
    x = torch.randn(5, 72, device=dev).to(dtype)
    w_fp8, w_scale = quantize_weight((torch.randn(72, 40, device=dev) * 0.05).t(), E4M3, "tensor")
    assert not w_fp8.is_contiguous()
    bias = torch.randn(40, device=dev).to(dtype)
    kwargs = dict(activation_granularity="tensor", weight_granularity="tensor")
    out = fp8_linear(x, w_fp8, w_scale, bias, kernel="scaled_mm", **kwargs)
    a_fp8, a_scale = quantize_activation(x, E4M3, "tensor", None, 128)
    ref = reference_linear(dequantize(a_fp8, a_scale), dequantize(w_fp8, w_scale), bias)
    assert out.dtype == dtype and out.is_contiguous()
    assert_close_to_reference(out.cpu(), _cpu(ref), dtype, fp8_tensor_cores=True)


@pytest.mark.cuda
@pytest.mark.skipif(not has_fp8_gemm(), reason="needs a CUDA GPU with compute capability >= 8.9")
@pytest.mark.parametrize(("scheme", "w_gran"), [("dynamic", "row"), ("static", "tensor")])
def test_cuda_fp8_linear_under_torch_compile(scheme, w_gran) -> None:
    """One inductor graph (fullgraph: no break at the capability check), same numbers."""
    dev = torch.device("cuda")
    w_fp8, w_scale = quantize_weight(torch.randn(100, 64, device=dev) * 0.05, E4M3, w_gran)
    bias = torch.randn(100, device=dev, dtype=torch.bfloat16)
    kwargs = dict(
        activation_scheme=scheme, weight_granularity=w_gran,
        activation_granularity="tensor" if scheme == "static" else "token",
        input_scale=torch.tensor([0.01], device=dev) if scheme == "static" else None,
    )  # fmt: skip

    def fn(x):
        return fp8_linear(x, w_fp8, w_scale, bias, kernel="scaled_mm", **kwargs)

    compiled_fn = torch.compile(fn, fullgraph=True, dynamic=True)
    for m in (7, 48):
        x = torch.randn(m, 64, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            torch.testing.assert_close(compiled_fn(x), fn(x), rtol=2**-7, atol=1e-2)


def _cpu(ref):
    return type(ref)(ref.out.cpu(), ref.mm_abs.cpu(), ref.abs_sum.cpu())


def test_input_width_must_match_in_features() -> None:
    w_fp8, w_scale = _weight(24, 40)
    with pytest.raises(RuntimeError, match=r"in_features=40"):
        fp8_linear(torch.randn(3, 41), w_fp8, w_scale)
    with pytest.raises(RuntimeError, match=r"in_features=40"):
        fp8_linear(torch.tensor(1.0), w_fp8, w_scale)
