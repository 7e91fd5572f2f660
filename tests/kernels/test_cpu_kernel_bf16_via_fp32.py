"""bf16 products above the GEMV limit as fp32 matmuls (``cpu_kernel.BF16_VIA_FP32``).

Where torch's bf16 matmul has no fast kernel (oneDNN without bf16 support: AVX2 CPUs), the
tiled decode + matmul and the per-expert matmuls multiply the same bf16 operands in fp32
(exact) and round each output to bf16 once, as the bf16 matmul does. References: the float64
product of the exact operands with the bound of tests/kernels/test_cpu_kernel.py, and the bf16
matmul route (``BF16_VIA_FP32 = False``) within twice that bound. A spy checks which route ran.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel, emulated, grouped
from hf_fp8.numerics import quantize_weight
from hf_fp8.recipe import Fp8Recipe
from tests.kernels.test_cpu_kernel import (
    BLOCK,
    FORMATS,
    SCHEMES,
    _activation,
    _bound,
    _expand64,
    _problem,
    path,  # noqa: F401  (fixture: every C path this CPU runs)
)

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def matmul_dtypes(monkeypatch):
    """The dtypes of the operands of every ``torch.mm`` / ``addmm`` / ``F.linear`` call."""
    seen: list[torch.dtype] = []
    for owner, name in ((torch, "mm"), (torch, "addmm"), (torch.nn.functional, "linear")):
        real = getattr(owner, name)

        def spy(*args, _real=real, **kwargs):
            seen.extend(t.dtype for t in args if isinstance(t, torch.Tensor))
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", False)
    return seen


def _linear(x, w8, ws, bias, gran, kwargs, monkeypatch, via_fp32: bool):
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", via_fp32)
    return emulated.emulated_linear(x, w8, ws, bias, gran, BLOCK, **kwargs)


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
@pytest.mark.parametrize(("m", "k", "n"), [(17, 300, 75), (40, 96, 70)])
def test_linear_via_fp32_matches_float64_and_the_bf16_matmul(
    matmul_dtypes, monkeypatch, fmt, gran, m, k, n
) -> None:
    dtype = FORMATS[fmt]
    w8, ws, w64, bias, x = _problem(fmt, gran, m, k, n)
    for scheme in SCHEMES:
        a64, kwargs = _activation(x, scheme, dtype)
        ref = a64 @ w64.T + bias.double()
        matmul_dtypes.clear()
        out = _linear(x, w8, ws, bias, gran, kwargs, monkeypatch, True)
        assert matmul_dtypes and set(matmul_dtypes) == {torch.float32}, (scheme, matmul_dtypes)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        blocky = 2.0**-8 if "block" in (gran, SCHEMES[scheme][0]) else 0.0
        bound = _bound(a64, w64, ref, 2.0**-8, 2.0**-16 + blocky) + 2.0**-8 * (a64 @ w64.T).abs()
        err = (out.double() - ref).abs()
        assert bool((err <= bound).all()), f"{scheme}: {float((err / bound).max()):.2f}x bound"
        matmul_dtypes.clear()
        bf16 = _linear(x, w8, ws, bias, gran, kwargs, monkeypatch, False)
        assert torch.bfloat16 in matmul_dtypes, f"{scheme}: the bf16 matmul did not run"
        diff = (out.double() - bf16.double()).abs()
        assert bool((diff <= 2 * bound).all()), f"{scheme} vs the bf16 matmul"


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("gran", ["row", "block"])
@pytest.mark.parametrize(("act", "a_gran"), [("weight_only", None), ("dynamic", "token")])
def test_experts_via_fp32_match_float64_and_the_bf16_matmul(
    matmul_dtypes, monkeypatch, gran, act, a_gran
) -> None:
    # every expert gets more rows than the GEMV takes on any path (16 where bf16 dots exist)
    experts, n, k, tokens = 3, 40, 64, 2 * cpu_kernel.GEMV_MAX_TOKENS
    gen = torch.Generator().manual_seed(0)
    pairs = [
        quantize_weight(
            torch.randn(n, k, generator=gen) * 0.05 * (1 + 20 * e), E4M3, gran, (16, 16)
        )
        for e in range(experts)
    ]
    w8, ws = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    bias = torch.randn(experts, n).to(torch.bfloat16)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    index = torch.arange(tokens * 2).remainder(experts).reshape(tokens, 2)
    routing = grouped.route(index, experts)
    recipe = Fp8Recipe.resolve(
        act, weight_granularity=gran, activation_granularity=a_gran, block_size=(16, 16)
    )
    outs = {}
    for via_fp32 in (True, False):
        monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", via_fp32)
        matmul_dtypes.clear()
        rows = x[routing.token_index]
        outs[via_fp32] = grouped.grouped_fp8_linear(rows, routing, w8, ws, bias, recipe=recipe)
        want = torch.float32 if via_fp32 else torch.bfloat16
        assert matmul_dtypes and want in matmul_dtypes, (via_fp32, matmul_dtypes)
        if via_fp32:
            assert torch.bfloat16 not in matmul_dtypes, matmul_dtypes
    # float64 reference: each routed pair's exact product (fp8 activations where quantized)
    rows = x[routing.token_index].double()
    experts_of = index.reshape(-1)[routing.pair_index]
    w64 = torch.stack(
        [w8[e].double() * _expand64(ws[e], n, k, gran, (16, 16)) for e in range(experts)]
    )
    ref = torch.stack([rows[i] @ w64[e].T for i, e in enumerate(experts_of.tolist())])
    ref = ref + bias.double()[experts_of]
    scale = (rows.abs() @ w64.abs().amax(0).T) + ref.abs()
    rel = 2.0**-5 if act == "dynamic" else 2.0**-7  # fp8 activations, bf16 rounding
    for via_fp32, out in outs.items():
        assert out.dtype == torch.bfloat16
        assert bool(((out.double() - ref).abs() <= rel * scale).all()), via_fp32
    diff = (outs[True].double() - outs[False].double()).abs()
    assert bool((diff <= 2.0**-7 * scale).all())


def test_the_route_follows_the_cpu(monkeypatch) -> None:
    """Auto: fp32 products where oneDNN has no bf16 support, the bf16 matmul elsewhere."""
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", None)
    for supported in (True, False):
        monkeypatch.setattr(cpu_kernel, "_mkldnn_bf16", lambda s=supported: s)
        assert cpu_kernel.bf16_matmul_via_fp32() is (not supported)
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", False)
    assert cpu_kernel.bf16_matmul_via_fp32() is False
