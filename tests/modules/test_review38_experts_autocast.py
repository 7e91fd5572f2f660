"""R38 F2 for MoE experts: FP8 experts follow ``torch.autocast`` as their source class does.

The source experts multiply with ``F.linear`` / ``bmm`` per expert, which CPU autocast runs in
bf16; the FP8 experts' projections (``grouped_fp8_linear``) ignored autocast and computed in
float32. Now each projection runs in the autocast dtype (autocast off inside), bit for bit
what it gives for rows cast to that dtype outside autocast, and the module returns the dtype
the source module returns under the same autocast. References: ``F.linear`` under autocast
(dtype), the source class with the dequantized weights under autocast (dtype, values).
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8 import Fp8Config
from hf_fp8.kernels import grouped
from hf_fp8.modules.fp8_experts import Fp8Experts, experts_layout
from hf_fp8.numerics import quantize_weight
from hf_fp8.recipe import Fp8Recipe
from tests.modules.moe_zoo import build_tiny, experts_classes, routed_inputs

E, N, K = 3, 48, 64


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
@pytest.mark.parametrize("tokens", [6, 60])  # the GEMV and the matmul routes per expert
def test_grouped_projection_follows_autocast(scheme, tokens) -> None:
    gen = torch.Generator().manual_seed(0)
    pairs = [quantize_weight(torch.randn(N, K, generator=gen) * 0.05, torch.float8_e4m3fn,
                             "row", (128, 128)) for _ in range(E)]  # fmt: skip
    w8 = torch.stack([p[0] for p in pairs])
    ws = torch.stack([p[1] for p in pairs])
    bias = torch.randn(E, N, generator=gen)
    x = torch.randn(tokens, K, generator=gen)
    index = torch.arange(tokens * 2).remainder(E).reshape(tokens, 2)
    routing = grouped.route(index, E)
    recipe = Fp8Recipe.resolve(scheme)
    rows = x[routing.token_index]
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = grouped.grouped_fp8_linear(rows, routing, w8, ws, bias, recipe=recipe)
            want_dtype = torch.nn.functional.linear(rows, w8[0].float()).dtype
        outside = grouped.grouped_fp8_linear(
            rows.to(torch.bfloat16), routing, w8, ws, bias, recipe=recipe
        )
    assert want_dtype == torch.bfloat16
    assert got.dtype == want_dtype
    assert torch.equal(got, outside)


def test_experts_module_under_autocast_matches_its_source() -> None:
    cls = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")
    source = build_tiny(cls)
    fp8 = Fp8Experts.from_experts(source, Fp8Config("weight_only"))
    back = fp8.dequantize()  # the source class with the dequantized weights
    layout = experts_layout(source)
    x, index, weights = routed_inputs(layout.hidden_size, layout.num_experts, tokens=60)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = fp8(x, index, weights)
        want = back(x, index, weights)
    assert got.dtype == want.dtype
    rel = float((got.double() - want.double()).norm() / want.double().norm())
    assert rel < 2e-2, rel  # two bf16 computations (rounded at different points)
