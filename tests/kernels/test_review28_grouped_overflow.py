"""R28 A: huge but finite activations through the grouped (MoE) CPU route.

Experts with more rows than the GEMV limit multiply the activation by *unscaled* fp8 codes
(``torch.mm`` on the decoded codes, then the emulation's epilogue) wherever the fused C GEMM
does not run (``cpu_kernel.FUSED_MM=False``, AVX2 with ``BF16_VIA_FP32``, AVX-512 without
BF16, AMX): activations near ``FLT_MAX / 448`` overflowed those sums to +-inf where the
dequantized model is finite. Reference: the float64 product of each row with its expert's
dequantized weight (``numerics.dequantize``), never the code under test.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel, grouped
from hf_fp8.numerics import dequantize, quantize_weight
from hf_fp8.recipe import Fp8Recipe

E4M3 = torch.float8_e4m3fn
EXPERTS, N, K, TOKENS = 2, 64, 96, 40


@pytest.fixture(params=["default", "nofused", "via_fp32"])
def route(request, monkeypatch) -> str:
    if cpu_kernel.active_path() is None:
        pytest.skip("no C kernel here: the grouped CPU route does not run")
    if request.param == "nofused":
        monkeypatch.setattr(cpu_kernel, "FUSED_MM", False)
        monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", False)
    elif request.param == "via_fp32":
        monkeypatch.setattr(cpu_kernel, "FUSED_MM", False)
        monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", True)
    return request.param


def _case(wg: str, huge: float, bias: bool):
    gen = torch.Generator().manual_seed(0)
    pairs = [
        quantize_weight(torch.randn(N, K, generator=gen) * 0.05, E4M3, wg, (32, 32))
        for _ in range(EXPERTS)
    ]
    w8 = torch.stack([p[0] for p in pairs])
    ws = torch.stack([p[1] for p in pairs])
    b = torch.randn(EXPERTS, N, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(TOKENS, K, generator=gen)
    x[:, 5] = huge
    x[:, 50] = -huge / 3
    x = x.to(torch.bfloat16)
    index = torch.arange(TOKENS * 2).remainder(EXPERTS).reshape(TOKENS, 2)
    routing = grouped.route(index, EXPERTS)
    rows = x[routing.token_index]
    experts_of = index.reshape(-1)[routing.pair_index].tolist()
    deq = [dequantize(w8[e], ws[e], torch.float64, wg, (32, 32)) for e in range(EXPERTS)]
    ref = torch.stack([rows[i].double() @ deq[e].T for i, e in enumerate(experts_of)])
    terms = torch.stack([rows[i].double().abs() @ deq[e].abs().T for i, e in enumerate(experts_of)])
    if b is not None:
        ref = ref + b.double()[experts_of]
    return rows, routing, w8, ws, b, ref, terms


@pytest.mark.parametrize("wg", ["row", "tensor", "block"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("huge", [1e37, 3e38])
def test_weight_only_experts_finite(route, wg, bias, huge):
    rows, routing, w8, ws, b, ref, terms = _case(wg, huge, bias)
    recipe = Fp8Recipe.resolve("weight_only", weight_granularity=wg, block_size=(32, 32))
    out = grouped.grouped_fp8_linear(rows, routing, w8, ws, b, recipe=recipe)
    assert ref.isfinite().all() and ref.abs().max() < 3e38
    bad = int((~out.isfinite()).sum())
    assert bad == 0, f"{route} {wg}: {bad} of {out.numel()} outputs not finite, reference finite"
    err = ((out.double() - ref).abs() / (ref.abs() + terms)).max().item()
    assert err < 2e-2, err
