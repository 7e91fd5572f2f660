"""The inductor-compiled helpers: same numbers as the eager twin, isolation, fallback."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import compiled as compiled_module
from hf_fp8.kernels import fp8_linear
from hf_fp8.kernels.emulated import _decode_weight
from hf_fp8.numerics import dequantize, quantize_weight
from tests.kernels.reference import E4M3, assert_close_to_reference, fake_quant, reference_linear


@pytest.fixture(autouse=True)
def _emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the compiled emulation: keep the C CPU kernels out of the way."""
    monkeypatch.setenv("HF_FP8_CPU_KERNEL", "off")


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
@pytest.mark.parametrize("m", [1, 7])  # 1: fused GEMV, 7: decode + matmul
def test_compiled_matches_eager_and_the_reference(monkeypatch, compiled, scheme, m) -> None:
    x = torch.randn(m, 300, dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_weight(torch.randn(70, 300) * 0.05, E4M3)
    bias = torch.randn(70, dtype=torch.bfloat16)
    calls = []
    real = compiled_module._compiled
    monkeypatch.setattr(compiled_module, "_compiled", lambda *a: calls.append(a) or real(*a))
    out = fp8_linear(x, w_fp8, w_scale, bias, activation_scheme=scheme)
    assert calls, "the compiled helper did not run"
    compiled_calls = len(calls)
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    eager = fp8_linear(x, w_fp8, w_scale, bias, activation_scheme=scheme)
    assert len(calls) == compiled_calls
    torch.testing.assert_close(out, eager, rtol=2**-8, atol=1e-6)
    a = x.float() if scheme == "weight_only" else fake_quant(x.float(), "token")
    ref = reference_linear(a, dequantize(w_fp8, w_scale), bias)
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.parametrize(
    ("scheme", "a_gran", "w_gran", "dtype", "m"),
    [
        ("static", "tensor", "row", torch.bfloat16, 7),
        ("dynamic", "tensor", "tensor", torch.float32, 7),
        ("weight_only", None, "tensor", torch.float16, 2),
    ],
)
def test_compiled_matches_eager_for_other_recipes(
    monkeypatch, compiled, scheme, a_gran, w_gran, dtype, m
) -> None:
    x = torch.randn(m, 200).to(dtype)
    w_fp8, w_scale = quantize_weight(torch.randn(40, 200) * 0.05, E4M3, w_gran)
    kwargs = dict(
        activation_scheme=scheme, activation_granularity=a_gran, weight_granularity=w_gran,
        input_scale=torch.tensor([0.01]) if scheme == "static" else None,
    )  # fmt: skip
    out = fp8_linear(x, w_fp8, w_scale, **kwargs)
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    torch.testing.assert_close(out, fp8_linear(x, w_fp8, w_scale, **kwargs), rtol=2**-8, atol=1e-6)


def test_each_static_configuration_gets_its_own_dynamo_cache() -> None:
    """dynamo caches per code object and gives up after 8 variants: one clone per key."""
    key_a = (_decode_weight, (("dtype", torch.bfloat16),))
    key_b = (_decode_weight, (("dtype", torch.float16),))
    fa, fb = (
        compiled_module._compiled(_decode_weight, key_a),
        compiled_module._compiled(_decode_weight, key_b),
    )
    assert compiled_module._compiled(_decode_weight, key_a) is fa
    code_a = fa._torchdynamo_orig_callable.__code__
    code_b = fb._torchdynamo_orig_callable.__code__
    assert code_a is not code_b and code_a is not _decode_weight.__code__
    assert code_a.co_code == _decode_weight.__code__.co_code


def test_a_failing_compiler_falls_back_to_eager_with_one_warning(monkeypatch, compiled) -> None:
    attempts = []

    def broken(fn, key):
        def run(*args, **kwargs):
            attempts.append(key)
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(compiled_module, "_compiled", broken)
    monkeypatch.setattr(compiled_module, "_FAILED", set())
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_weight(torch.randn(16, 64), E4M3)
    with pytest.warns(RuntimeWarning, match="compiling .* failed.*HF_FP8_COMPILE=0"):
        out = fp8_linear(x, w_fp8, w_scale, activation_scheme="weight_only")
    assert len(attempts) == 1
    again = fp8_linear(x, w_fp8, w_scale, activation_scheme="weight_only")
    assert len(attempts) == 1, "a failed configuration must not be compiled again"
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    assert torch.equal(out, again)
    assert torch.equal(out, fp8_linear(x, w_fp8, w_scale, activation_scheme="weight_only"))


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_hf_fp8_compile_0_never_compiles(monkeypatch, value) -> None:
    def forbidden(*args):
        raise AssertionError("compiled although HF_FP8_COMPILE=0")

    monkeypatch.setattr(compiled_module, "_compiled", forbidden)
    monkeypatch.setenv("HF_FP8_COMPILE", value)
    assert not compiled_module.compile_enabled()
    x = torch.randn(3, 32)
    w_fp8, w_scale = quantize_weight(torch.randn(8, 32), E4M3)
    fp8_linear(x, w_fp8, w_scale)


def test_meta_tensors_stay_eager(monkeypatch, compiled) -> None:
    monkeypatch.setattr(compiled_module, "_compiled", lambda *a: pytest.fail("compiled meta"))
    x = torch.empty(4, 32, device="meta", dtype=torch.bfloat16)
    w_fp8 = torch.empty(8, 32, device="meta", dtype=E4M3)
    out = fp8_linear(x, w_fp8, torch.empty(8, 1, device="meta"), activation_scheme="weight_only")
    assert out.shape == (4, 8) and out.device.type == "meta"


def test_an_input_error_is_raised_and_does_not_disable_compilation(monkeypatch, compiled) -> None:
    def fragile(fn, key):
        def run(*args, **kwargs):
            return fn(*args, **kwargs)  # what the compiled function does on bad inputs

        return run

    monkeypatch.setattr(compiled_module, "_compiled", fragile)
    monkeypatch.setattr(compiled_module, "_FAILED", set())
    with pytest.raises(RuntimeError):
        compiled_module.run(torch.mm, torch.randn(2, 3), torch.randn(4, 5))
    assert not compiled_module._FAILED


def _scaled_rows(x: torch.Tensor, w: torch.Tensor, *, tag: str) -> torch.Tensor:
    return (x.float() * 2.0) @ w.float().T


def test_views_strides_and_parameters_do_not_recompile(compiled) -> None:
    """An input reshaped from 3-D (a view), a transposed one and a Parameter weight all run
    the first graph: dynamo would otherwise guard on the base, the strides, the static
    Parameter shape — one recompile each, and eager after 8."""
    from torch._dynamo.utils import counters

    w = torch.nn.Parameter(torch.randn(24, 40), requires_grad=False)
    calls = [
        torch.randn(5, 40),
        torch.randn(2, 3, 40).reshape(6, 40),  # a view with a 3-D base
        torch.randn(40, 7).t(),  # non-contiguous
        torch.randn(9, 40),
    ]
    before = counters["stats"]["unique_graphs"]
    for x in calls:
        out = compiled_module.run(_scaled_rows, x, w, tag="recompile-test")
        torch.testing.assert_close(out, _scaled_rows(x, w, tag=""))
    assert counters["stats"]["unique_graphs"] - before == 1
