"""R24 F4: the grouped (MoE) CPU route with bf16 products as fp32 matmuls
(``cpu_kernel.BF16_VIA_FP32``, AVX2 CPUs) decoded a whole expert to bf16 and then made a
full fp32 copy of it (``w.float()``): one 8192 x 4096 expert (32 MiB of fp8) cost +220 MiB of
peak RSS against +10 MiB for the dense tiled route. It now decodes and multiplies tile by
tile, as ``cpu_kernel._fp8_mm_impl`` does. Checked two ways: the largest fp32 weight operand
handed to a matmul (a spy), and the process's peak RSS growth (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``). The numbers: the float64 product of the exact operands.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_fp8.kernels import cpu_kernel, grouped
from hf_fp8.numerics import quantize_weight
from hf_fp8.recipe import Fp8Recipe
from tests.kernels.test_cpu_kernel import _expand64, path  # noqa: F401  (fixture)

E4M3 = torch.float8_e4m3fn


def _experts(experts: int, n: int, k: int, gran: str):
    gen = torch.Generator().manual_seed(0)
    pairs = [
        quantize_weight(torch.randn(n, k, generator=gen) * 0.05, E4M3, gran, (128, 128))
        for _ in range(experts)
    ]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _routing(tokens: int, experts: int):
    index = torch.arange(tokens * 2).remainder(experts).reshape(tokens, 2)
    return index, grouped.route(index, experts)


@pytest.fixture
def fp32_operands(monkeypatch):
    """Bytes of every fp32 tensor handed to torch.mm / addmm / F.linear."""
    seen: list[int] = []
    for owner, name in ((torch, "mm"), (torch, "addmm"), (F, "linear")):
        real = getattr(owner, name)

        def spy(*args, _real=real, **kwargs):
            seen.extend(
                t.numel() * 4
                for t in args
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32
            )
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", False)
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", True)
    return seen


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("gran", ["row", "block"])
@pytest.mark.parametrize(("act", "a_gran"), [("weight_only", None), ("dynamic", "token")])
def test_expert_products_run_tile_by_tile_and_match_float64(
    fp32_operands, gran, act, a_gran
) -> None:
    experts, n, k, tokens = 2, 1024, 2048, 40  # 8 MiB of fp32 weight per expert
    w8, ws = _experts(experts, n, k, gran)
    bias = torch.randn(experts, n).to(torch.bfloat16)
    x = torch.randn(tokens, k).to(torch.bfloat16)
    index, routing = _routing(tokens, experts)
    recipe = Fp8Recipe.resolve(act, weight_granularity=gran, activation_granularity=a_gran)
    rows = x[routing.token_index]
    out = grouped.grouped_fp8_linear(rows, routing, w8, ws, bias, recipe=recipe)
    assert fp32_operands, "no fp32 matmul ran"
    assert max(fp32_operands) <= cpu_kernel.TILE_BYTES, (
        f"an fp32 operand of {max(fp32_operands) >> 20} MiB: a whole expert, not a tile"
    )
    experts_of = index.reshape(-1)[routing.pair_index]
    w64 = torch.stack([w8[e].double() * _expand64(ws[e], n, k, gran, (128, 128)) for e in (0, 1)])
    r64 = rows.double()
    ref = torch.stack([r64[i] @ w64[e].T for i, e in enumerate(experts_of.tolist())])
    ref = ref + bias.double()[experts_of]
    scale = torch.stack([r64[i].abs() @ w64[e].abs().T for i, e in enumerate(experts_of.tolist())])
    rel = 2.0**-5 if act == "dynamic" else 2.0**-7  # fp8 activations, bf16 rounding
    assert bool(((out.double() - ref).abs() <= rel * (scale + ref.abs())).all())


def _peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_peak_memory_of_a_large_expert_stays_near_the_dense_route(monkeypatch) -> None:
    monkeypatch.setenv(cpu_kernel.ENV, "avx2" if "avx2" in cpu_kernel.supported_paths() else "")
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", False)
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", True)
    experts, n, k, tokens = 2, 4096, 4096, 32  # 16 MiB of fp8 per expert, 64 MiB as fp32
    w8 = torch.randint(0, 0x7E, (experts, n, k), dtype=torch.uint8).view(E4M3)
    ws = torch.rand(experts, n, 1) * 1e-3
    x = torch.randn(tokens, k).to(torch.bfloat16)
    _, routing = _routing(tokens, experts)
    recipe = Fp8Recipe.resolve("weight_only")
    rows = x[routing.token_index]
    small = grouped.grouped_fp8_linear(rows[:, :256], routing, w8[:, :64, :256].contiguous(),
                                       ws[:, :64], None, recipe=recipe)  # fmt: skip
    assert small.shape == (rows.shape[0], 64)  # warm-up: libraries, allocator, thread pools
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    before = _rss_kib()
    out = grouped.grouped_fp8_linear(rows, routing, w8, ws, None, recipe=recipe)
    growth_mib = (_peak_kib() - before) / 1024
    assert out.shape == (rows.shape[0], n)
    # the whole-expert route: a 32 MiB bf16 decode plus its 64 MiB fp32 copy (~100 MiB)
    assert growth_mib < 40, f"peak RSS grew by {growth_mib:.0f} MiB"
