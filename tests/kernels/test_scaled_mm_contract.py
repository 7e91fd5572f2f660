"""The arguments ``scaled_mm_linear`` gives ``torch._scaled_mm`` obey the CUDA contract.

No GPU here: every call is replayed on fake CUDA tensors of the same shapes, strides and
dtypes, which runs torch's own CUDA-side checks (``_meta_registrations``: row-major ``a``,
column-major ``b``, K and N multiples of 16, scale shapes, dtypes and contiguity), plus
the checks of ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` and ``RowwiseScaledMM.cu`` that
the meta function does not repeat (bias dtype and size, row-wise output and weight dtype,
two e5m2 operands). The real CPU ``_scaled_mm`` then computes the result.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_fp8.kernels import (
    has_fp8_gemm,
    quantize_activation,
    scaled_mm_linear,
    unsupported_reason,
)
from hf_fp8.numerics import dequantize, quantize_weight
from tests.kernels.reference import E4M3, assert_close_to_reference, reference_linear

capability = importlib.import_module("hf_fp8.kernels.capability")
_REAL_SCALED_MM = torch._scaled_mm


def _cuda_twin(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cuda")


def check_cuda_contract(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_result: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> None:
    """Raise when ``torch._scaled_mm`` would reject these arguments on an sm89 / sm90 GPU."""
    with FakeTensorMode():
        out = _REAL_SCALED_MM(
            _cuda_twin(a),
            _cuda_twin(b),
            scale_a=_cuda_twin(scale_a),
            scale_b=_cuda_twin(scale_b),
            bias=_cuda_twin(bias),
            scale_result=_cuda_twin(scale_result),
            out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
        )
    assert out.shape == (a.shape[0], b.shape[1])
    out_dtype = out_dtype or a.dtype
    # ScaledBlas.cpp: "Multiplication of two Float8_e5m2 matrices is not supported"
    assert not (a.dtype == b.dtype == torch.float8_e5m2)
    assert scale_a.dtype == scale_b.dtype == torch.float32
    rowwise = not (scale_a.numel() == 1 and scale_b.numel() == 1)
    if rowwise:  # RowwiseScaledMM.cu check_inputs (the CUTLASS kernel of sm89 / sm90)
        assert out_dtype == torch.bfloat16, "row-wise CUTLASS kernel writes bf16 only"
        assert b.dtype == torch.float8_e4m3fn, "row-wise CUTLASS kernel needs an e4m3 b"
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        assert scale_a.stride(0) == 1 and scale_b.stride(1) == 1
    if bias is not None:  # ScaledBlas.cpp bias checks
        assert out_dtype != torch.float32, "Bias is not supported when out_dtype is Float32"
        assert bias.dtype == out_dtype, "bias must be bf16 for bf16 output, fp16 for fp16"
        assert bias.dim() == 1 and bias.numel() == b.shape[1] and bias.stride(0) == 1


@pytest.fixture
def contract_checked(monkeypatch):
    """Check every ``torch._scaled_mm`` call against the CUDA contract, then run it."""
    calls = []

    def spy(*args, **kwargs):
        check_cuda_contract(*args, **kwargs)
        calls.append(kwargs)
        return _REAL_SCALED_MM(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


def test_the_checker_catches_what_a_gpu_rejects() -> None:
    a = torch.zeros(4, 32, dtype=E4M3)
    w = torch.zeros(48, 32, dtype=E4M3)
    one = torch.tensor(1.0)
    check_cuda_contract(a, w.t(), one, one, out_dtype=torch.bfloat16)
    bad = [
        dict(b=torch.zeros(32, 48, dtype=E4M3)),  # row-major b
        dict(a=torch.zeros(4, 40, dtype=E4M3), b=torch.zeros(48, 40, dtype=E4M3).t()),  # K=40
        dict(scale_a=torch.ones(4, 1), scale_b=torch.ones(48, 2)[:, :1].t()),  # strided
        dict(scale_a=torch.ones(4, 1), scale_b=torch.ones(48, 1)),  # b scale not [1, N]
        dict(scale_a=torch.ones(4, 1), scale_b=torch.ones(1, 48), out_dtype=torch.float16),
        dict(bias=torch.zeros(48), out_dtype=torch.bfloat16),  # fp32 bias, bf16 output
        dict(bias=torch.zeros(40, dtype=torch.bfloat16), out_dtype=torch.bfloat16),
        dict(bias=torch.zeros(48, dtype=torch.float32), out_dtype=torch.float32),
        dict(a=a.view(torch.float8_e5m2), b=w.view(torch.float8_e5m2).t()),
    ]
    for override in bad:
        kwargs = dict(a=a, b=w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        kwargs.update(override)
        with pytest.raises((RuntimeError, AssertionError)):
            check_cuda_contract(**kwargs)


# (activation, weight) granularity and output dtype: row-wise only with bf16 output (the
# dispatch sends the others to the emulation), tensor-wise with every output dtype.
_SCALINGS = [
    ("token", "row", torch.bfloat16),
    ("token", "tensor", torch.bfloat16),
    ("tensor", "row", torch.bfloat16),
    *[("tensor", "tensor", dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)],
]


@pytest.mark.parametrize(("a_gran", "w_gran", "out_dtype"), _SCALINGS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 16, 16), (3, 40, 24), (17, 64, 100)])
def test_scaled_mm_linear_meets_the_cuda_contract(
    contract_checked, a_gran, w_gran, out_dtype, with_bias, m, k, n
) -> None:
    x = torch.randn(m, k).to(out_dtype)
    w_fp8, w_scale = quantize_weight(torch.randn(n, k) * 0.05, E4M3, w_gran)
    bias = torch.randn(n).to(out_dtype) if with_bias else None
    a_fp8, a_scale = quantize_activation(x, E4M3, a_gran, None, 128)
    out = scaled_mm_linear(a_fp8, a_scale, w_fp8, w_scale, bias, out_dtype)
    assert len(contract_checked) == 1
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    ref = reference_linear(dequantize(a_fp8, a_scale), dequantize(w_fp8, w_scale), bias)
    assert_close_to_reference(out, ref, out_dtype)


def test_non_contiguous_operands_are_made_row_major(contract_checked) -> None:
    """A GPT-2 ``Conv1D`` weight quantized through its transpose keeps the transposed
    strides, and an input may be a transposed view: both would break the layout rule."""
    w_fp8, w_scale = quantize_weight((torch.randn(64, 48) * 0.05).t(), E4M3, "row")
    assert not w_fp8.is_contiguous()
    x = torch.randn(64, 5, dtype=torch.bfloat16).t()
    a_fp8, a_scale = quantize_activation(x, E4M3, "token", None, 128)
    assert not a_fp8.is_contiguous()
    bias = torch.randn(48, dtype=torch.bfloat16)
    out = scaled_mm_linear(a_fp8, a_scale, w_fp8, w_scale, bias, torch.bfloat16)
    ref = reference_linear(dequantize(a_fp8, a_scale), dequantize(w_fp8, w_scale), bias)
    assert_close_to_reference(out, ref, torch.bfloat16)


def test_one_row_transposed_view_is_made_row_major(contract_checked) -> None:
    """``[1, K]`` with strides ``(1, 1)`` counts as contiguous, yet is not row-major."""
    a_fp8 = (torch.randn(32, 1) * 4).to(E4M3).t()
    assert a_fp8.is_contiguous() and a_fp8.stride() == (1, 1)
    w_fp8, w_scale = quantize_weight(torch.randn(16, 32) * 0.05, E4M3, "tensor")
    one = torch.tensor([1.0])
    out = scaled_mm_linear(a_fp8, one, w_fp8, w_scale, None, torch.bfloat16)
    ref = reference_linear(dequantize(a_fp8, one), dequantize(w_fp8, w_scale), None)
    assert_close_to_reference(out, ref, torch.bfloat16)


def test_rocm_is_sent_to_the_emulation_with_its_own_reason(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4")
    reason = unsupported_reason(
        torch.device("cuda"), torch.bfloat16, E4M3, E4M3, "tensor", "tensor"
    )
    assert reason is not None and "ROCm" in reason and "fnuz" in reason


def test_has_fp8_gemm_by_capability(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    for cc, expected in [((8, 6), False), ((8, 9), True), ((9, 0), True), ((12, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None, c=cc: c)
        assert has_fp8_gemm("cuda") is expected
        assert has_fp8_gemm(torch.device("cuda", 0)) is expected
    assert not has_fp8_gemm("cpu")
    assert not has_fp8_gemm(torch.device("meta"))
    monkeypatch.setattr(torch.version, "hip", "6.4")  # MI300 reports 9.4 but wants fnuz
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 4))
    assert not has_fp8_gemm("cuda")


def test_has_fp8_gemm_is_a_constant_under_torch_compile(monkeypatch) -> None:
    """No graph break (fullgraph) and no CUDA call traced into the graph."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # dynamo saves and restores the CUDA RNG state around tracing when CUDA is available
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: torch.empty(0, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: None)
    monkeypatch.setattr(torch.version, "hip", None)
    # opaque to dynamo (as the real CUDA query is): fullgraph fails unless the capability
    # check is a compile-time constant
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", torch._dynamo.disable(lambda i=None: (9, 0))
    )

    def fn(x):
        return x + 1 if has_fp8_gemm(torch.device("cuda")) else x - 1

    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend="eager", fullgraph=True)(torch.zeros(2))
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, torch.ones(2))
