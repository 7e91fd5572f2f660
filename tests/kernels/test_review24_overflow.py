"""R24 F1 / F2: huge but finite activations through an FP8 linear on every CPU route.

The fused GEMV multiplies activations by *unscaled* fp8 codes (the weight scale comes after
the sum, or after each K-block's partial sum), and the post-scaled matmul routes multiply
unscaled codes too: with activations near 1e37-3e38 those sums overflowed fp32 to +-inf where
the dequantized model is finite. Reference: the float64 product of the fake-quantized
activation and the dequantized weight (``numerics``), never the code under test. Wherever it
is finite and inside the compute dtype's range, the output must be finite and close to it.
"""

from __future__ import annotations

import pytest
import torch

import hf_fp8
from hf_fp8.kernels import cpu_kernel, cpu_linear
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.numerics import dequantize, quantize
from tests.kernels.test_cpu_kernel import PATHS, _expand64

BLOCK = (16, 32)
# (scheme, weight granularity, activation granularity, compute dtype, tokens, huge value)
CASES = [
    ("dynamic", "block", "block", torch.float32, 1, 3e38),  # R24 F1: the GEMV, fp32
    ("dynamic", "block", "block", torch.bfloat16, 1, 3e38),
    ("dynamic", "block", "block", torch.bfloat16, 12, 3e38),  # the AVX2 bf16 GEMV limit
    ("dynamic", "block", "block", torch.bfloat16, 24, 3e38),  # decode + matmul
    ("weight_only", "row", None, torch.float32, 1, 1e37),  # R24 F2: the GEMV epilogue
    ("weight_only", "row", None, torch.bfloat16, 1, 1e37),
    ("weight_only", "row", None, torch.bfloat16, 13, 1e37),  # post-scaled matmul
    ("weight_only", "tensor", None, torch.bfloat16, 40, 1e37),
    ("dynamic", "row", "token", torch.bfloat16, 40, 1e38),  # per-token scales: no overflow
]


@pytest.fixture(params=[*PATHS, "off"])
def route(request, monkeypatch) -> str:
    if request.param == "unavailable":
        pytest.skip(f"no C kernel builds here: {cpu_kernel.failure('scalar')}")
    monkeypatch.setenv(cpu_kernel.ENV, request.param)
    monkeypatch.setenv("HF_FP8_COMPILE", "0")  # the eager emulation: same numbers, no compile
    return request.param


def _layer(scheme, wg, ag, dtype) -> Fp8Linear:
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(40, generator=gen))
    cfg = hf_fp8.Fp8Config(
        scheme, weight_granularity=wg, activation_granularity=ag, block_size=BLOCK
    )
    return Fp8Linear.from_linear(lin.to(dtype), cfg)


def _reference(layer: Fp8Linear, x: torch.Tensor, ag: str | None):
    """(float64 output, float64 sum of |terms|) of the fake-quantized activation and the
    dequantized weight."""
    x32 = x.float()
    if ag is None:
        a = x32.double()
    else:
        gran = {"token": "row", "block": "block"}[ag]
        q, s = quantize(x32, layer.weight.dtype, gran, (1, BLOCK[1]))
        a = dequantize(q, s, torch.float32, gran, (1, BLOCK[1])).double()
    n, k = layer.weight.shape
    wg = layer._plan.weight_granularity
    w = layer.weight.double() * _expand64(layer.weight_scale.float(), n, k, wg, BLOCK)
    return a @ w.T + layer.bias.double(), a.abs() @ w.abs().T


@pytest.mark.parametrize("via_fp32", [True, False])
@pytest.mark.parametrize(("scheme", "wg", "ag", "dtype", "m", "big"), CASES)
def test_huge_activations_stay_finite_and_close(
    route, monkeypatch, via_fp32, scheme, wg, ag, dtype, m, big
) -> None:
    if not via_fp32 and (dtype != torch.bfloat16 or m <= cpu_kernel.GEMV_MAX_TOKENS):
        pytest.skip("the bf16 matmul route only exists above the GEMV")
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", via_fp32)
    layer = _layer(scheme, wg, ag, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, 96, generator=gen)
    x[0, 5] = big
    x[m - 1, 50] = big
    x[m // 2, 70] = -big
    x = x.to(dtype)
    with torch.no_grad():
        out = layer(x)
    ref, terms = _reference(layer, x, ag)
    limit = torch.finfo(dtype).max * (1 - 2.0**-7)
    inside = ref.abs() < limit
    assert bool(inside.any())
    assert bool(ref[inside].abs().max() > 1e30), "the problem does not reach the huge range"
    bad = inside & ~out.isfinite()
    assert not bool(bad.any()), (
        f"{route}: {int(bad.sum())} non-finite outputs where float64 is finite, first at "
        f"{bad.nonzero()[0].tolist()}"
    )
    r = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-16
    err = (out.double() - ref).abs()
    assert bool((err[inside] <= (r * (ref.abs() + terms) + 1e-30)[inside]).all())


def test_block_activations_keep_the_measured_avx2_gemv_limit() -> None:
    # the AVX2 GEMV reads fp32 activations whatever their granularity (no bf16 dot products
    # there), so the 12-token crossover measured for bf16 compute holds for block activations
    assert cpu_linear.gemv_limit("avx2", torch.bfloat16, True) == 12
    assert cpu_linear.gemv_limit("avx2", torch.bfloat16, False) == 12
    assert cpu_linear.gemv_limit("avx512bf16", torch.bfloat16, True) == 4
