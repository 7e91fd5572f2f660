"""R38 F1 on the grouped (MoE) CPU route: an overflowing token leaves its expert's other
tokens alone.

An expert whose post-scaled product overflowed (weight-only, a token near ``FLT_MAX / 448``
times unscaled codes) was multiplied again with folded scales for all its rows, so the other
tokens routed to it changed bits. Now only the rows that need it are taken from the redo.
References: the same tokens without the huge one (bit for bit), and the float64 product with
the dequantized weight (``numerics.dequantize``) for the huge token's rows.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel, grouped
from hf_fp8.numerics import dequantize, quantize_weight
from hf_fp8.recipe import Fp8Recipe

E4M3 = torch.float8_e4m3fn
EXPERTS, N, K, TOKENS, HUGE = 2, 64, 96, 40, 7


@pytest.fixture(params=["default", "nofused", "via_fp32"])
def route(request, monkeypatch) -> str:
    if cpu_kernel.active_path() is None:
        pytest.skip("no C kernel here: the grouped CPU route does not run")
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", None if request.param == "default" else False)
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", request.param == "via_fp32")
    return request.param


@pytest.mark.parametrize("wg", ["row", "tensor"])
def test_a_huge_token_leaves_the_experts_other_tokens(route, wg):
    gen = torch.Generator().manual_seed(0)
    pairs = [
        quantize_weight(torch.randn(N, K, generator=gen) * 0.05, E4M3, wg, (32, 32))
        for _ in range(EXPERTS)
    ]
    w8 = torch.stack([p[0] for p in pairs])
    ws = torch.stack([p[1] for p in pairs])
    b = torch.randn(EXPERTS, N, generator=gen).to(torch.bfloat16)
    x = torch.randn(TOKENS, K, generator=gen).to(torch.bfloat16)
    y = x.clone()
    y[HUGE] = torch.where(x[HUGE] >= 0, 3e37, -3e37).to(torch.bfloat16)
    index = torch.arange(TOKENS * 2).remainder(EXPERTS).reshape(TOKENS, 2)  # both experts
    routing = grouped.route(index, EXPERTS)
    recipe = Fp8Recipe.resolve("weight_only", weight_granularity=wg, block_size=(32, 32))
    clean = grouped.grouped_fp8_linear(x[routing.token_index], routing, w8, ws, b, recipe=recipe)
    out = grouped.grouped_fp8_linear(y[routing.token_index], routing, w8, ws, b, recipe=recipe)
    mine = routing.token_index == HUGE
    assert int(mine.sum()) == 2
    changed = out[~mine] != clean[~mine]
    assert not bool(changed.any()), f"{route}: {int(changed.sum())} outputs of other tokens"
    experts_of = index.reshape(-1)[routing.pair_index]
    for i in mine.nonzero().flatten().tolist():
        e = int(experts_of[i])
        deq = dequantize(w8[e], ws[e], torch.float64, wg, (32, 32))
        ref = y[HUGE].double() @ deq.T + b[e].double()
        terms = y[HUGE].double().abs() @ deq.abs().T
        assert bool(out[i].isfinite().all()) and float(ref.abs().max()) > 1e30
        assert bool(((out[i].double() - ref).abs() <= 2.0**-7 * (ref.abs() + terms)).all())
