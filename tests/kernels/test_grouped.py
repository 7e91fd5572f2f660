"""Grouped FP8 matmuls of MoE experts: routing, per-expert numerics, the CUDA contract.

The per-expert route is compared with a dequantize-then-matmul reference per expert (fp32,
activations fake-quantized with the numerics functions). ``torch._scaled_grouped_mm`` has
no CPU kernel: its calls are replayed on fake CUDA tensors (torch's own meta checks of
``_meta_grouped_mm_common``) plus the rules of ``GroupedBlas.cpp`` that the meta function
does not repeat, then computed by a reference here.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_fp8.numerics import dequantize, quantize_weight, quantize_with_scale
from hf_fp8.recipe import Fp8Recipe
from tests.kernels.reference import E4M3, fake_quant

grouped = importlib.import_module("hf_fp8.kernels.grouped")
grouped_cpu = importlib.import_module("hf_fp8.kernels.grouped_cpu")
E5M2 = torch.float8_e5m2
FORMATS = {E4M3: "e4m3", E5M2: "e5m2"}
DYNAMIC = Fp8Recipe.resolve()
_REAL_SCALED_GROUPED_MM = torch._scaled_grouped_mm


def _experts(num_experts=5, n=32, k=48, gran="row", dtype=E4M3, block=(16, 16), seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(num_experts, n, k, generator=gen) * 0.05
    w[1] *= 30  # experts with very different ranges keep their own scales
    pairs = [quantize_weight(w[e], dtype, gran, block) for e in range(num_experts)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _reference(x, index, w_fp8, w_scale, bias, *, gran, block, act, a_gran=None, scales=None):
    """fp32 ``[T·k, N]`` in flattened (token, k) order, one routed pair at a time."""
    flat = index.reshape(-1)
    rows = x.repeat_interleave(index.shape[1], dim=0)
    out = torch.zeros(rows.shape[0], w_fp8.shape[1])
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero().squeeze(-1)
        a = rows[sel]
        if act == "static":
            s = scales[e].reshape(1)
            a = dequantize(quantize_with_scale(a, s, w_fp8.dtype, "tensor"), s)
        elif act == "dynamic":
            a = fake_quant(a, a_gran, block[1], dtype=w_fp8.dtype)
        w = dequantize(w_fp8[e], w_scale[e], torch.float32, gran, block)
        out[sel] = a @ w.T + (0 if bias is None else bias[e])
    return out


def _sorted_rows(x, routing):
    return x[routing.token_index]


def _unsort(out_sorted, routing):
    full = torch.zeros(routing.num_tokens * routing.top_k, out_sorted.shape[1])
    full[routing.pair_index] = out_sorted.float()
    return full


def test_route_sorts_pairs_by_expert_and_drops_sentinels() -> None:
    index = torch.tensor([[3, 0], [3, 5], [1, 3]])  # 5 == num_experts: an EP sentinel
    routing = grouped.route(index, 5)
    assert routing.counts == (1, 1, 0, 3, 0)
    assert routing.expert_ids.tolist() == [0, 1, 3, 3, 3]
    assert routing.pair_index.tolist() == [1, 4, 0, 2, 5]  # stable within an expert
    assert routing.token_index.tolist() == [0, 2, 0, 1, 2]
    assert routing.present() == [(0, 0, 1), (1, 1, 2), (3, 2, 5)]
    with pytest.raises(ValueError, match=r"\[tokens, top_k\]"):
        grouped.route(index.reshape(-1), 5)


def test_combine_weights_and_sums_per_token() -> None:
    index = torch.tensor([[2, 0], [1, 2]])
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    routing = grouped.route(index, 3)
    out_sorted = torch.arange(4.0).unsqueeze(-1).expand(4, 2)  # value = sorted row number
    got = grouped.combine(out_sorted, routing, weights, torch.float32)
    # sorted pairs: (t0, e0)=0, (t1, e1)=1, (t0, e2)=2, (t1, e2)=3
    expected = torch.tensor([[0.25 * 2 + 0.75 * 0] * 2, [0.5 * 1 + 0.5 * 3] * 2])
    assert torch.equal(got, expected)
    # a dropped (sentinel) pair adds nothing
    routing = grouped.route(torch.tensor([[2, 3], [1, 2]]), 3)
    got = grouped.combine(torch.arange(3.0).unsqueeze(-1), routing, weights, torch.float32)
    assert got.squeeze(-1).tolist() == [0.25 * 1, 0.5 * 0 + 0.5 * 2]


def test_combine_dropped_pairs_ignore_their_weight_and_gradients_flow() -> None:
    """A sentinel pair adds zero even with a NaN weight; expert outputs and routing weights
    get the gradients of ``sum_k w[t, k] * out[pair(t, k)]``."""
    index = torch.tensor([[2, 3], [1, 2], [0, 1]])  # 3: a sentinel (num_experts 3)
    routing = grouped.route(index, 3)
    weights = torch.tensor([[0.25, float("nan")], [0.5, 0.5], [0.3, 0.7]], requires_grad=True)
    expert_out = torch.randn(5, 4, requires_grad=True)
    got = grouped.combine(expert_out, routing, weights, torch.float32)
    assert torch.isfinite(got).all()
    full = torch.zeros(6, 4)
    full[routing.pair_index] = expert_out
    ref = (full.view(3, 2, 4) * torch.nan_to_num(weights).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(got, ref)
    got.sum().backward()
    assert weights.grad[0, 1] == 0
    expected_w = full.view(3, 2, 4).sum(-1)
    torch.testing.assert_close(weights.grad[[0, 1, 1, 2, 2], [0, 0, 1, 0, 1]],
                               expected_w[[0, 1, 1, 2, 2], [0, 0, 1, 0, 1]])  # fmt: skip
    flat_w = torch.nan_to_num(weights.detach()).reshape(-1)[routing.pair_index]
    torch.testing.assert_close(expert_out.grad, flat_w.unsqueeze(-1).expand(5, 4))


@pytest.mark.parametrize("gran", ["row", "tensor", "block"])
@pytest.mark.parametrize(
    ("act", "a_gran"),
    [("weight_only", None), ("dynamic", "token"), ("dynamic", "tensor"), ("static", "tensor")],
)
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_per_expert_route_equals_dequantize_then_matmul(gran, act, a_gran, fmt) -> None:
    w_fp8, w_scale = _experts(gran=gran, dtype=fmt)
    bias = torch.randn(5, 32)
    x = torch.randn(7, 48)
    index = torch.tensor([[0, 3], [3, 1], [1, 0], [0, 3], [3, 0], [1, 3], [0, 1]])
    scales = torch.tensor([0.01, 0.02, 0.03, 0.015, 0.05]) if act == "static" else None
    routing = grouped.route(index, 5)
    got = grouped.grouped_fp8_linear(
        _sorted_rows(x, routing),
        routing,
        w_fp8,
        w_scale,
        bias,
        recipe=Fp8Recipe.resolve(
            act,
            weight_granularity=gran,
            activation_granularity=a_gran,
            fp8_format=FORMATS[fmt],
            block_size=(16, 16),
        ),
        input_scale=scales,
    )
    ref = _reference(
        x, index, w_fp8, w_scale, bias, gran=gran, block=(16, 16), act=act, a_gran=a_gran,
        scales=scales,
    )  # fmt: skip
    full = _unsort(got, routing)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)


def test_only_routed_experts_are_multiplied(monkeypatch) -> None:
    """One fp8_linear per expert present; an unrouted expert (NaN weights) costs nothing."""
    w_fp8, w_scale = _experts(num_experts=8)
    w_fp8[5] = float("nan")
    calls = []
    real = grouped.fp8_linear

    def spy(x, w, *args, **kwargs):
        calls.append((x.shape[0], w.shape))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(grouped, "fp8_linear", spy)
    monkeypatch.setattr(grouped_cpu, "fp8_linear", spy)  # the CPU route's small experts
    index = torch.tensor([[0, 7], [7, 2], [2, 0]])
    routing = grouped.route(index, 8)
    out = grouped.grouped_fp8_linear(torch.randn(6, 48), routing, w_fp8, w_scale, recipe=DYNAMIC)
    assert sorted(calls) == [(2, (32, 48))] * 3  # experts 0, 2, 7: two rows each, 2-D slices
    assert torch.isfinite(out).all()


def test_no_tokens_and_shape_errors() -> None:
    w_fp8, w_scale = _experts()
    routing = grouped.route(torch.zeros(0, 2, dtype=torch.long), 5)
    out = grouped.grouped_fp8_linear(torch.zeros(0, 48), routing, w_fp8, w_scale, recipe=DYNAMIC)
    assert out.shape == (0, 32)
    routing = grouped.route(torch.tensor([[0, 1]]), 5)
    with pytest.raises(ValueError, match="one row per routed pair"):
        grouped.grouped_fp8_linear(torch.zeros(3, 48), routing, w_fp8, w_scale, recipe=DYNAMIC)
    with pytest.raises(ValueError, match="does not fit 4 experts"):
        grouped.grouped_fp8_linear(torch.zeros(2, 48), grouped.route(torch.tensor([[0, 1]]), 4),
                                   w_fp8, w_scale, recipe=DYNAMIC)  # fmt: skip
    with pytest.raises(RuntimeError, match="calibrate"):
        grouped.grouped_fp8_linear(torch.zeros(2, 48), routing, w_fp8, w_scale,
                                   recipe=Fp8Recipe.resolve("static"))  # fmt: skip
    with pytest.raises(ValueError, match="recipe's format is 'e5m2'"):
        grouped.grouped_fp8_linear(torch.zeros(2, 48), routing, w_fp8, w_scale,
                                   recipe=Fp8Recipe.resolve(fp8_format="e5m2"))  # fmt: skip


def test_gradients_reach_the_input() -> None:
    """Straight-through: d out / d x = dequantized weight of the row's expert."""
    w_fp8, w_scale = _experts()
    index = torch.tensor([[0, 4], [4, 1]])
    routing = grouped.route(index, 5)
    x = torch.randn(4, 48, requires_grad=True)
    grouped.grouped_fp8_linear(x, routing, w_fp8, w_scale, recipe=DYNAMIC).sum().backward()
    w = torch.stack([dequantize(w_fp8[e], w_scale[e]) for e in range(5)])
    expected = w[routing.expert_ids].sum(1)
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)


# -- torch._scaled_grouped_mm (CUDA) ---------------------------------------------------------


def _cuda_twin(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cuda")


def check_grouped_contract(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                           out_dtype=None, use_fast_accum=False) -> None:  # fmt: skip
    """Raise when ``torch._scaled_grouped_mm`` would reject these arguments on sm90 / sm100."""
    with FakeTensorMode():
        out = _REAL_SCALED_GROUPED_MM(
            _cuda_twin(a), _cuda_twin(b), _cuda_twin(scale_a), _cuda_twin(scale_b),
            offs=_cuda_twin(offs), bias=_cuda_twin(bias), scale_result=_cuda_twin(scale_result),
            out_dtype=out_dtype, use_fast_accum=use_fast_accum,
        )  # fmt: skip
    assert out.shape == (a.shape[0], b.shape[2]) and out.dtype == torch.bfloat16
    # GroupedBlas.cpp rules the meta function leaves out
    assert a.dim() == 2 and b.dim() == 3, "2-D x 3-D: rows grouped by offs"
    assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0 and b.shape[2] % 16 == 0
    assert b.shape[0] <= 1024
    assert scale_a.shape == (a.shape[0],) and scale_a.is_contiguous()
    assert scale_b.shape == (b.shape[0], b.shape[2]) and scale_b.stride(1) == 1
    assert offs.dtype == torch.int32 and offs.shape == (b.shape[0],)
    assert int(offs[-1]) == a.shape[0], "every row belongs to a group"
    assert bool((offs[1:] >= offs[:-1]).all())


def _reference_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    out = torch.empty(a.shape[0], b.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        acc = a[start:end].float() @ b[g].float()
        out[start:end] = acc * scale_a[start:end, None] * scale_b[g][None, :]
        start = end
    return out.to(out_dtype)


@pytest.fixture
def grouped_gpu(monkeypatch):
    """Pretend an sm90 GPU: the grouped path runs, each call checked, then computed here."""
    calls = []

    def spy(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
            use_fast_accum=False):  # fmt: skip
        check_grouped_contract(a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype,
                               use_fast_accum)  # fmt: skip
        calls.append(offs.tolist())
        return _reference_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", spy)
    monkeypatch.setattr(grouped, "grouped_unsupported_reason", lambda *a, **k: None)
    return calls


def test_the_checker_catches_what_a_gpu_rejects() -> None:
    a = torch.zeros(6, 32, dtype=E4M3)
    w = torch.zeros(3, 48, 32, dtype=E4M3)
    sa, sb = torch.ones(6), torch.ones(3, 48)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    check_grouped_contract(a, w.transpose(-2, -1), sa, sb, offs, out_dtype=torch.bfloat16)
    bad = [
        dict(b=torch.zeros(3, 32, 48, dtype=E4M3)),  # row-major b
        dict(a=a.view(E5M2)),
        dict(scale_a=torch.ones(6, 1)),
        dict(scale_b=torch.ones(3, 1)),
        dict(offs=offs.long()),
        dict(offs=torch.tensor([2, 2, 5], dtype=torch.int32)),
        dict(bias=torch.zeros(48, dtype=torch.bfloat16)),
        dict(out_dtype=torch.float16),
        dict(a=torch.zeros(6, 40, dtype=E4M3), b=torch.zeros(3, 48, 40, dtype=E4M3).mT),
    ]
    for override in bad:
        kwargs = dict(a=a, b=w.transpose(-2, -1), scale_a=sa, scale_b=sb, offs=offs,
                      out_dtype=torch.bfloat16)  # fmt: skip
        kwargs.update(override)
        with pytest.raises((RuntimeError, AssertionError)):
            check_grouped_contract(**kwargs)


@pytest.mark.parametrize(("act", "a_gran"), [("dynamic", "token"), ("dynamic", "tensor"),
                                             ("static", "tensor")])  # fmt: skip
@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_grouped_mm_meets_the_cuda_contract(grouped_gpu, act, a_gran, gran, with_bias):
    w_fp8, w_scale = _experts(num_experts=6, gran=gran)
    bias = torch.randn(6, 32).to(torch.bfloat16) if with_bias else None
    x = torch.randn(8, 48).to(torch.bfloat16)
    index = torch.tensor([[0, 5], [5, 1], [1, 0], [0, 5], [5, 0], [1, 5], [0, 1], [2, 5]])
    scales = torch.tensor([0.01, 0.02, 0.03, 0.015, 0.05, 0.02]) if act == "static" else None
    routing = grouped.route(index, 6)
    recipe = Fp8Recipe.resolve(act, weight_granularity=gran, activation_granularity=a_gran)
    got = grouped.grouped_fp8_linear(x[routing.token_index], routing, w_fp8, w_scale, bias,
                                     recipe=recipe, input_scale=scales)  # fmt: skip
    assert grouped_gpu == [[5, 9, 10, 10, 10, 16]], "one launch, cumulative row ends per expert"
    emulated = dataclasses.replace(recipe, kernel="emulated")
    ref = grouped.grouped_fp8_linear(x[routing.token_index], routing, w_fp8, w_scale, bias,
                                     recipe=emulated, input_scale=scales)  # fmt: skip
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-7)


def test_grouped_path_is_skipped_for_gradients_and_emulated(grouped_gpu) -> None:
    w_fp8, w_scale = _experts()
    routing = grouped.route(torch.tensor([[0, 1]]), 5)
    x = torch.randn(2, 48, dtype=torch.bfloat16, requires_grad=True)
    grouped.grouped_fp8_linear(x, routing, w_fp8, w_scale, recipe=DYNAMIC)
    emulated = Fp8Recipe.resolve(kernel="emulated")
    grouped.grouped_fp8_linear(x.detach(), routing, w_fp8, w_scale, recipe=emulated)
    assert grouped_gpu == []


def test_grouped_unsupported_reasons(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16

    def reason(cc=(9, 0), out=bf16, act=E4M3, w=E4M3, ag="row", wg="row", n=32, k=48, e=8):
        monkeypatch.setattr(grouped, "_cuda_capability", lambda i, c=cc: c)
        return grouped.grouped_unsupported_reason(cuda, out, act, w, ag, wg, n, k, e)

    assert reason() is None and reason(cc=(10, 0)) is None and reason(ag="tensor") is None
    assert "9.0 or 10.0" in reason(cc=(8, 9))
    assert "9.0 or 10.0" in reason(cc=(12, 0))
    assert "e4m3" in reason(w=E5M2)
    assert "weight-only" in reason(act=None)
    assert "block" in reason(wg="block")
    assert "bfloat16" in reason(out=torch.float16)
    assert "multiples of 16" in reason(k=40)
    assert "1024" in reason(e=2048)
    assert "CUDA only" in grouped.grouped_unsupported_reason(
        torch.device("cpu"), bf16, E4M3, E4M3, "row", "row", 32, 48, 8
    )
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "ROCm" in reason()


@pytest.mark.parametrize(("act", "a_gran", "gran"), [("dynamic", "token", "row"),
                                                     ("static", "tensor", "tensor")])  # fmt: skip
def test_per_expert_scaled_mm_meets_the_cuda_contract(monkeypatch, act, a_gran, gran) -> None:
    """Where the grouped kernel cannot run (here: an sm89-like FP8 GPU), each expert present
    gets one ``torch._scaled_mm``, every call checked against the CUDA contract."""
    from tests.kernels.test_scaled_mm_contract import check_cuda_contract

    scaled_mm_module = importlib.import_module("hf_fp8.kernels.scaled_mm")
    monkeypatch.setattr(scaled_mm_module, "has_fp8_gemm", lambda device: True)
    real = torch._scaled_mm
    calls = []

    def spy(*args, **kwargs):
        check_cuda_contract(*args, **kwargs)
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    w_fp8, w_scale = _experts(num_experts=6, n=40, k=24, gran=gran)  # N, K not multiples of 16
    bias = torch.randn(6, 40).to(torch.bfloat16)
    x = torch.randn(5, 24).to(torch.bfloat16)
    index = torch.tensor([[0, 5], [5, 1], [1, 0], [0, 5], [5, 0]])
    scales = torch.tensor([0.01, 0.02, 0.03, 0.015, 0.05, 0.02]) if act == "static" else None
    routing = grouped.route(index, 6)
    recipe = Fp8Recipe.resolve(act, weight_granularity=gran, activation_granularity=a_gran)
    rows = x[routing.token_index]
    got = grouped.grouped_fp8_linear(rows, routing, w_fp8, w_scale, bias, recipe=recipe,
                                     input_scale=scales)  # fmt: skip
    assert sorted(calls) == [2, 4, 4]  # experts 1, 0 and 5
    emulated = dataclasses.replace(recipe, kernel="emulated")
    ref = grouped.grouped_fp8_linear(rows, routing, w_fp8, w_scale, bias, recipe=emulated,
                                     input_scale=scales)  # fmt: skip
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-7)


def test_route_under_deterministic_algorithms() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        routing = grouped.route(torch.tensor([[3, 0], [3, 5], [1, 3]]), 5)
    finally:
        torch.use_deterministic_algorithms(False)
    assert routing.counts == (1, 1, 0, 3, 0)


# -- the CPU route (hf_fp8.kernels.grouped_cpu) ------------------------------------------------


def _skewed_routing(seed=3):
    """40 tokens, top-2 over 5 experts: experts 0, 3 and 4 get 20 or more rows (above every
    GEMV limit), 1 gets 3, 2 gets none; tokens span six orders of magnitude, so a
    row quantized with another row's (or the wrong group's) scale is far off."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 48, generator=gen) * torch.logspace(-3, 3, 40).unsqueeze(-1)
    first = torch.where(torch.arange(40) < 20, 0, 4)
    second = torch.full((40,), 3)
    second[:3] = 1
    return x, torch.stack([first, second], dim=1)


@pytest.mark.parametrize("gran", ["row", "tensor", "block"])
@pytest.mark.parametrize(
    ("act", "a_gran"),
    [("weight_only", None), ("dynamic", "token"), ("dynamic", "tensor"), ("dynamic", "block"),
     ("static", "tensor")],
)  # fmt: skip
@pytest.mark.parametrize(("dtype", "fused"), [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.bfloat16, True)])  # fmt: skip
@pytest.mark.parametrize("from_tokens", [False, True])
def test_cpu_route_equals_the_reference(monkeypatch, gran, act, a_gran, dtype, fused, from_tokens):
    """Every expert above the GEMV limit is decoded once and multiplied once (decode +
    torch.mm, or the fused C decode + GEMM); the result is the fp32 dequantize-then-matmul
    reference (fp32 compute) or the per-expert FP8 linear (bf16 compute: same numerics, up to
    fp32 reassociation inside the matmul)."""
    from hf_fp8.kernels import cpu_kernel

    path = cpu_kernel.active_path()
    if path is None:
        pytest.skip("the C CPU kernels are unavailable here")
    if fused and path not in cpu_kernel.BF16_ACTIVATION_PATHS:
        pytest.skip(f"the fused C decode + GEMM needs {cpu_kernel.BF16_ACTIVATION_PATHS}")
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", fused)
    decoded = []
    real_decode, real_mm = cpu_kernel.decode, cpu_kernel.fused_mm
    monkeypatch.setattr(cpu_kernel, "decode", lambda w, *a, **k: decoded.append(w.data_ptr())
                        or real_decode(w, *a, **k))  # fmt: skip
    monkeypatch.setattr(cpu_kernel, "fused_mm", lambda a, w, *r, **k: decoded.append(
        w.data_ptr()) or real_mm(a, w, *r, **k))  # fmt: skip
    w_fp8, w_scale = _experts(gran=gran)
    bias = torch.randn(5, 32)
    x, index = _skewed_routing()
    scales = torch.tensor([30.0, 0.02, 0.03, 20.0, 10.0]) / 448 if act == "static" else None
    recipe = Fp8Recipe.resolve(act, weight_granularity=gran, activation_granularity=a_gran,
                               block_size=(16, 16))  # fmt: skip
    routing = grouped.route(index, 5)
    x = x.to(dtype)
    got = grouped.grouped_fp8_linear(
        x if from_tokens else x[routing.token_index], routing, w_fp8, w_scale, bias,
        recipe=recipe, input_scale=scales, from_tokens=from_tokens,
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == (80, 32)
    big = {w_fp8[0].data_ptr(), w_fp8[3].data_ptr(), w_fp8[4].data_ptr()}
    assert set(decoded) == big and len(decoded) == 3, "each large expert decoded once"
    full = _unsort(got, routing)
    if dtype == torch.float32:
        ref = _reference(x, index, w_fp8, w_scale, bias, gran=gran, block=(16, 16), act=act,
                         a_gran=a_gran, scales=scales)  # fmt: skip
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    else:
        # the fp32 reference of the exact bf16 inputs, row by row (tokens span six orders of
        # magnitude: a tolerance from the largest row would not see a small row's error);
        # bf16 rounds the folded weight, the fake-quantized activation, the product and the
        # result: a few 2^-9 relative steps
        ref = _reference(x.float(), index, w_fp8, w_scale, bias, gran=gran, block=(16, 16),
                         act=act, a_gran=a_gran, scales=scales)  # fmt: skip
        err = (full - ref).abs().amax(1)
        bound = 2**-6 * ref.abs().amax(1)
        assert bool((err <= bound).all()), (err / ref.abs().amax(1)).max()


def test_per_token_scales_are_computed_once_per_token(monkeypatch) -> None:
    """Dynamic per-token activations: the token rows are quantized once (40 rows, not the 80
    routed pairs), and the result is bit for bit that of quantizing each pair's row."""
    from hf_fp8.kernels import cpu_kernel, cpu_linear

    if cpu_kernel.active_path() is None:
        pytest.skip("the C CPU kernels are unavailable here")
    w_fp8, w_scale = _experts()
    x, index = _skewed_routing()
    index[:3, 1] = 0  # expert 1 empty: every expert present is above the GEMV limit
    index[:3, 0] = 4
    routing = grouped.route(index, 5)
    quantized = []
    real = cpu_linear._quantize_act
    monkeypatch.setattr(cpu_linear, "_quantize_act", lambda a, *r, **k: quantized.append(
        a.shape[0]) or real(a, *r, **k))  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        quantized.clear()
        xd = x.to(dtype)
        once = grouped.grouped_fp8_linear(xd, routing, w_fp8, w_scale, recipe=DYNAMIC,
                                          from_tokens=True)  # fmt: skip
        assert quantized == [40]
        per_pair = grouped.grouped_fp8_linear(xd[routing.token_index], routing, w_fp8, w_scale,
                                              recipe=DYNAMIC)  # fmt: skip
        assert quantized == [40, 80]
        assert torch.equal(once, per_pair)
        ref = _reference(xd.float(), index, w_fp8, w_scale, None, gran="row", block=(16, 16),
                         act="dynamic", a_gran="token")  # fmt: skip
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(_unsort(once, routing), ref, rtol=tol,
                                   atol=tol * float(ref.abs().max()))  # fmt: skip


def test_from_tokens_checks_the_shape() -> None:
    w_fp8, w_scale = _experts()
    routing = grouped.route(torch.tensor([[0, 1], [1, 2]]), 5)
    with pytest.raises(ValueError, match=r"\[2, K\] \(one row per token\)"):
        grouped.grouped_fp8_linear(torch.zeros(4, 48), routing, w_fp8, w_scale, recipe=DYNAMIC,
                                   from_tokens=True)  # fmt: skip


@pytest.mark.parametrize("gran", ["row", "tensor", "block"])
@pytest.mark.parametrize(
    ("act", "a_gran"),
    [("weight_only", None), ("dynamic", "token"), ("dynamic", "tensor"), ("dynamic", "block"),
     ("static", "tensor")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_route_is_the_emulation_bit_for_bit(
    monkeypatch, gran, act, a_gran, dtype, with_bias
) -> None:
    """Experts above the GEMV limit: the same numbers as the emulation's own torch code
    (``emulated._mm_forward``, eager: fake-quantized activation, decoded weight, matmul,
    epilogue) run on that expert's rows alone."""
    from hf_fp8.kernels import cpu_kernel, emulated
    from hf_fp8.kernels.fp8_linear import LinearPlan

    if cpu_kernel.active_path() is None:
        pytest.skip("the C CPU kernels are unavailable here")
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", False)  # the decode + torch.mm route
    # bf16 products as bf16 matmuls, as the emulation's: the fp32 route (AVX2 CPUs) sums in
    # another order (tests/kernels/test_cpu_kernel_bf16_via_fp32.py bounds it)
    monkeypatch.setattr(cpu_kernel, "BF16_VIA_FP32", False)
    w_fp8, w_scale = _experts(gran=gran)
    bias = torch.randn(5, 32).to(dtype) if with_bias else None
    x, index = _skewed_routing()
    x = x.to(dtype)
    scales = torch.tensor([30.0, 0.02, 0.03, 20.0, 10.0]) / 448 if act == "static" else None
    recipe = Fp8Recipe.resolve(act, weight_granularity=gran, activation_granularity=a_gran,
                               block_size=(16, 16))  # fmt: skip
    plan = LinearPlan.from_recipe(recipe)
    routing = grouped.route(index, 5)
    got = grouped.grouped_fp8_linear(x, routing, w_fp8, w_scale, bias, recipe=recipe,
                                     input_scale=scales, from_tokens=True)  # fmt: skip
    compared = 0
    for e, start, end in routing.present():
        if end - start <= 16:
            continue
        expected = emulated._mm_forward(
            x[routing.token_index[start:end]], w_fp8[e], w_scale[e],
            None if bias is None else bias[e], None if scales is None else scales[e : e + 1],
            w_gran=gran, block_size=(16, 16), act_dtype=plan.act_dtype,
            a_gran=plan.act_granularity, w_post=emulated.post_scaled(gran, dtype),
            a_post=plan.act_dtype is not None and emulated.post_scaled(plan.act_granularity, dtype),
        )  # fmt: skip
        assert torch.equal(got[start:end], expected), f"expert {e}"
        compared += 1
    assert compared == 3


def test_from_tokens_without_the_cpu_route(monkeypatch) -> None:
    """Where the CPU route does not run (C kernels off, torch.compile, gradients), the token
    rows are gathered per pair and the per-expert route gives the same numbers."""
    w_fp8, w_scale = _experts()
    x, index = _skewed_routing()
    routing = grouped.route(index, 5)
    expected = grouped.grouped_fp8_linear(x[routing.token_index], routing, w_fp8, w_scale,
                                          recipe=DYNAMIC)  # fmt: skip
    monkeypatch.setattr(grouped_cpu, "cpu_path", lambda *a: None)
    calls = []
    real = grouped.fp8_linear
    monkeypatch.setattr(grouped, "fp8_linear", lambda x, *a, **k: calls.append(x.shape[0])
                        or real(x, *a, **k))  # fmt: skip
    got = grouped.grouped_fp8_linear(x, routing, w_fp8, w_scale, recipe=DYNAMIC, from_tokens=True)
    assert sorted(calls) == [3, 20, 20, 37]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
