"""Grouped FP8 matmuls for mixture-of-experts: only the routed (token, expert) pairs.

The ``S = tokens × top_k`` routed pairs are sorted by expert id (:func:`route`); each expert
then multiplies the contiguous block of rows it received, and an expert that received no
token costs nothing (no dense compute of all experts, no per-token Python loop).

Three ways to run one grouped projection (:func:`grouped_fp8_linear`):

* on the CPU with the C kernels (no gradients): :mod:`hf_fp8.kernels.grouped_cpu`, the
  emulation's numbers with one activation quantization pass (once per token for per-token
  scales), one whole-weight decode per expert into a reused buffer and one output buffer;
* per expert present (elsewhere, and for gradients): one ``hf_fp8.kernels.fp8_linear`` call on that expert's rows and
  weight slice. That is the FP8 linear of ``Fp8Linear``, so the numerics are those of a
  dequantize-then-matmul per expert (activations fake-quantized for dynamic / static), the
  kernel choice is the same (``torch._scaled_mm`` on FP8 GPUs, the emulation elsewhere)
  and gradients reach the input the same way.
* ``torch._scaled_grouped_mm`` (one CUDA launch for all experts) where torch supports the
  layout, checked by :func:`grouped_unsupported_reason`. Contract of the 2-D × 3-D call
  (torch 2.13, ``_meta_registrations._meta_grouped_mm_common`` and
  ``aten/src/ATen/native/cuda/GroupedBlas.cpp``): compute capability 9.0 or 10.0; ``a``
  ``[S, K]`` row-major ``float8_e4m3fn``, ``b`` ``[E, K, N]`` column-major
  ``float8_e4m3fn`` (the transposed view of a contiguous ``[E, N, K]`` weight); K and N
  multiples of 16; ``scale_a`` fp32 ``[S]`` contiguous (one per row), ``scale_b`` fp32
  ``[E, N]`` with unit last stride; ``offs`` int32 ``[E]`` cumulative row ends; no bias, no
  ``scale_result``; bfloat16 output; at most 1024 groups. Tensor-wise scales are expanded
  to those shapes; block scales and e5m2 take the per-expert route. It has no backward, so
  a call that needs gradients takes the per-expert route too.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from hf_fp8.kernels import grouped_cpu
from hf_fp8.kernels.fp8_linear import LinearPlan, autocast_dtype, fp8_linear
from hf_fp8.numerics import amax, amax_to_scale, fp8_dtype, quantize_with_scale
from hf_fp8.recipe import Fp8Recipe, Kernel

# torch._scaled_grouped_mm: GroupedBlas.cpp (CUTLASS grouped kernel) limits
_GROUPED_CAPABILITIES = ((9, 0), (10, 0))
_MAX_GROUPS = 1024


_plan = functools.lru_cache(maxsize=64)(LinearPlan.from_recipe)  # recipes are frozen


@dataclass(frozen=True)
class Routing:
    """The routed (token, k) pairs of one call, sorted by expert.

    ``pair_index`` ``[S]``: position of each sorted pair in the flattened ``[tokens · top_k]``
    routing tensors; ``token_index`` ``[S]``: its token; ``expert_ids`` ``[S]``: its expert
    (non-decreasing); ``counts``: rows per expert (host ints, one entry per expert).
    Pairs routed to an id outside ``[0, num_experts)`` (expert-parallel sentinels) are
    dropped: they contribute nothing.

    Static routing (``counts=None``, :func:`route` under ``torch.compile``): no host sync,
    every shape follows the input's; all ``tokens · top_k`` pairs are kept, the dropped ones
    sorted last with ``expert_ids == experts`` (one past the last expert), and
    ``experts`` holds the number of experts.
    """

    pair_index: torch.Tensor
    token_index: torch.Tensor
    expert_ids: torch.Tensor
    counts: tuple[int, ...] | None
    num_tokens: int
    top_k: int
    experts: int = 0  # static routing only: the number of experts

    @property
    def num_experts(self) -> int:
        return self.experts if self.counts is None else len(self.counts)

    @property
    def is_static(self) -> bool:
        return self.counts is None

    def present(self) -> list[tuple[int, int, int]]:
        """``(expert, start, end)`` row ranges of the experts that received rows."""
        if self.counts is None:
            raise RuntimeError("a static routing (under torch.compile) has no host row counts")
        out, start = [], 0
        for expert, count in enumerate(self.counts):
            if count:
                out.append((expert, start, start + count))
                start += count
        return out


def route(top_k_index: torch.Tensor, num_experts: int, *, static: bool | None = None) -> Routing:
    """Sort the routed pairs of ``top_k_index`` ``[tokens, top_k]`` by expert id.

    ``static`` (default: under ``torch.compile``): a static routing (see :class:`Routing`),
    whose sizes do not depend on the routing decisions, so one graph captures it."""
    if top_k_index.dim() != 2:
        raise ValueError(
            f"top_k_index must be [tokens, top_k], got shape {tuple(top_k_index.shape)}"
        )
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    # invalid ids sort past every real expert and are cut off below
    keys = torch.where(valid, flat, torch.full_like(flat, num_experts))
    sorted_ids, pair_index = torch.sort(keys, stable=True)
    if static is None:
        static = torch.compiler.is_compiling()
    if static:
        return Routing(
            pair_index=pair_index,
            token_index=pair_index // top_k,
            expert_ids=sorted_ids,
            counts=None,
            num_tokens=num_tokens,
            top_k=top_k,
            experts=num_experts,
        )
    # row ranges from the sorted ids (bincount has no deterministic CUDA kernel)
    bounds = torch.searchsorted(
        sorted_ids, torch.arange(num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    )
    counts_host = tuple(int(c) for c in bounds.diff().tolist())  # the one host sync
    routed = sum(counts_host)
    pair_index = pair_index[:routed]
    return Routing(
        pair_index=pair_index,
        token_index=pair_index // top_k,
        expert_ids=sorted_ids[:routed],
        counts=counts_host,
        num_tokens=num_tokens,
        top_k=top_k,
    )


def combine(
    expert_out: torch.Tensor,
    routing: Routing,
    top_k_weights: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[tokens, H]``: each sorted expert output times its routing weight (rounded to the
    expert output's dtype, as transformers' ``grouped_mm`` does), put back in (token, k)
    order and summed over k (torch accumulates the sum in fp32), then cast to ``out_dtype``.
    Deterministic: a gather and a sum, no ``index_add_``. Dropped (sentinel) pairs add zero.
    The rows are put in (token, k) order first and weighted there (in place when no gradient
    is recorded): one ``[tokens · top_k, H]`` temporary instead of two.
    """
    num_pairs = routing.num_tokens * routing.top_k
    routed = expert_out.shape[0]
    weights = top_k_weights.reshape(-1, 1).to(expert_out.dtype)
    if routing.is_static:  # every pair has a row; the dropped ones get weight zero
        dropped = routing.expert_ids >= routing.num_experts  # in sorted order
        dropped = torch.zeros_like(dropped).scatter(0, routing.pair_index, dropped)
        weights = weights.masked_fill(dropped.unsqueeze(-1), 0)
    elif routed < num_pairs:  # dropped pairs read this zero row, with weight zero
        expert_out = torch.cat([expert_out, expert_out.new_zeros(1, expert_out.shape[-1])])
        dropped = torch.ones(num_pairs, dtype=torch.bool, device=weights.device)
        dropped[routing.pair_index] = False
        weights = weights.masked_fill(dropped.unsqueeze(-1), 0)
    inverse = torch.full((num_pairs,), routed, dtype=torch.long, device=expert_out.device)
    inverse[routing.pair_index] = torch.arange(routed, device=expert_out.device)
    per_pair = expert_out.index_select(0, inverse)
    if torch.is_grad_enabled() and (per_pair.requires_grad or weights.requires_grad):
        per_pair = per_pair * weights
    else:
        per_pair.mul_(weights)
    return per_pair.view(routing.num_tokens, routing.top_k, -1).sum(dim=1).to(out_dtype)


@torch.compiler.assume_constant_result
def _cuda_capability(index: int | None) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def grouped_unsupported_reason(
    device: torch.device,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype | None,
    weight_dtype: torch.dtype,
    act_granularity: str | None,
    weight_granularity: str,
    n: int,
    k: int,
    num_experts: int,
) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run this grouped product, or ``None``.

    Granularities are the numerics names (``"tensor"``, ``"row"``, ``"block"``);
    ``act_dtype=None`` means weight-only (no FP8 activation).
    """
    if device.type != "cuda":
        return f"torch._scaled_grouped_mm runs on CUDA only; the input is on {device}"
    if torch.version.hip is not None:
        return "torch._scaled_grouped_mm on ROCm takes the *_fnuz fp8 dtypes"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    capability = _cuda_capability(device.index)
    if capability not in _GROUPED_CAPABILITIES:
        return (
            f"torch._scaled_grouped_mm needs compute capability 9.0 or 10.0, this GPU has "
            f"{capability[0]}.{capability[1]}"
        )
    if act_dtype is None:
        return "weight-only experts dequantize the weight instead of an FP8 gemm"
    if act_dtype != torch.float8_e4m3fn or weight_dtype != torch.float8_e4m3fn:
        return "torch._scaled_grouped_mm multiplies e4m3 operands only"
    if "block" in (act_granularity, weight_granularity):
        return "block-wise scales run per expert"
    if out_dtype != torch.bfloat16:
        return f"torch._scaled_grouped_mm writes bfloat16 only, not {out_dtype}"
    if k % 16 or n % 16:
        return f"torch._scaled_grouped_mm needs K and N multiples of 16, got K={k}, N={n}"
    if num_experts > _MAX_GROUPS:
        return f"torch._scaled_grouped_mm takes at most {_MAX_GROUPS} groups, got {num_experts}"
    return None


def _row_scales(
    x: torch.Tensor,
    routing: Routing,
    act_dtype: torch.dtype,
    act_granularity: str,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 ``[S, 1]`` activation scale of each sorted row: the expert's static scale, the
    row's own (``"row"``) or its expert's group amax (``"tensor"``)."""
    if input_scale is not None:
        return input_scale.float()[routing.expert_ids].unsqueeze(-1)
    row_amax = amax(x, "row")
    if act_granularity == "tensor":
        group = row_amax.new_zeros(routing.num_experts)
        group = group.scatter_reduce(0, routing.expert_ids, row_amax.squeeze(-1), "amax")
        row_amax = group[routing.expert_ids].unsqueeze(-1)
    return amax_to_scale(row_amax, act_dtype)


def _scaled_grouped(
    x: torch.Tensor,
    routing: Routing,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_dtype: torch.dtype,
    act_granularity: str,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """One ``torch._scaled_grouped_mm`` over every expert (see the module docstring)."""
    num_experts, n, _ = w_fp8.shape
    a_scale = _row_scales(x, routing, act_dtype, act_granularity, input_scale)
    a_fp8 = quantize_with_scale(x, a_scale, act_dtype, "row")
    w = w_fp8 if w_fp8.is_contiguous() else w_fp8.contiguous()
    scale_b = w_scale.float().reshape(num_experts, -1).expand(num_experts, n).contiguous()
    offsets = torch.tensor(routing.counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch._scaled_grouped_mm(
        a_fp8.contiguous(),
        w.transpose(-2, -1),
        a_scale.reshape(-1).contiguous(),
        scale_b,
        offs=offsets.to(x.device),
        out_dtype=torch.bfloat16,
        use_fast_accum=False,
    )
    if bias is not None:
        out = out + bias.to(out.dtype)[routing.expert_ids]
    return out


def grouped_fp8_linear(
    x_sorted: torch.Tensor,
    routing: Routing,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: Fp8Recipe,
    input_scale: torch.Tensor | None = None,
    from_tokens: bool = False,
) -> torch.Tensor:
    """Per-expert FP8 ``linear`` of the rows sorted by :func:`route`: ``[S, N]`` in
    ``x_sorted.dtype``.

    ``w_fp8`` ``[E, N, K]`` (one ``[N, K]`` weight per expert, in ``recipe.fp8_format``),
    ``w_scale`` ``[E, 1]`` (tensor), ``[E, N, 1]`` (row) or ``[E, N/bn, K/bk]`` (block),
    ``bias`` ``[E, N]``, ``input_scale`` ``[E]`` (static: one scale per expert). Each expert
    runs ``recipe`` as an ``Fp8Linear`` would; dynamic ``"tensor"`` activations get one scale
    per expert.

    ``from_tokens=True``: ``x_sorted`` is the ``[tokens, K]`` input itself and each routed
    pair reads its token's row (``x[routing.token_index]``, same result); on the CPU path a
    per-token activation scale is then computed once per token, not once per pair.

    Under CPU / CUDA ``torch.autocast`` the rows are cast to the autocast dtype and the result
    is in it, as the source experts' per-expert ``F.linear`` is (R38 F2).
    """
    dtype = autocast_dtype(x_sorted)
    if dtype is not None:
        with torch.autocast(x_sorted.device.type, enabled=False):
            return grouped_fp8_linear(
                x_sorted.to(dtype), routing, w_fp8, w_scale, bias, recipe=recipe,
                input_scale=input_scale, from_tokens=from_tokens,
            )  # fmt: skip
    rows = routing.num_tokens if from_tokens else len(routing.expert_ids)
    if x_sorted.dim() != 2 or x_sorted.shape[0] != rows:
        what = "one row per token" if from_tokens else "one row per routed pair"
        raise ValueError(f"x_sorted must be [{rows}, K] ({what}), got {tuple(x_sorted.shape)}")
    num_experts, n, k = w_fp8.shape
    if num_experts != routing.num_experts or x_sorted.shape[1] != k:
        raise ValueError(
            f"weight of shape {tuple(w_fp8.shape)} does not fit {routing.num_experts} experts "
            f"and inputs of width {x_sorted.shape[1]}"
        )
    if w_fp8.dtype != fp8_dtype(recipe.fp8_format):
        raise ValueError(
            f"expert weights are {w_fp8.dtype} but the recipe's format is "
            f"{recipe.fp8_format!r}: something cast the stored codes. With FSDP2 and a "
            "MixedPrecisionPolicy(param_dtype=...), shard the FP8 modules with "
            "hf_fp8.fully_shard_fp8(model) first; to compute in high precision, load with "
            "Fp8Config(dequantize=True)"
        )
    if recipe.is_static and input_scale is None:
        raise RuntimeError(
            "these static FP8 experts have no input scales: calibrate them with "
            "hf_fp8.calibrate(model, batches), or give Fp8Config('static', activation_scale=...)"
        )
    if not recipe.is_static:
        input_scale = None
    if routing.is_static:
        plan = LinearPlan.from_recipe(recipe)  # dynamo cannot trace the lru_cache
        return _static_grouped(
            x_sorted, routing, w_fp8, w_scale, bias, plan, input_scale, from_tokens
        )
    if len(routing.expert_ids) == 0:
        return x_sorted.new_zeros(0, n)

    act_dtype = fp8_dtype(recipe.fp8_format) if recipe.quantizes_activations else None
    a_layout = None if recipe.activation_layout is None else recipe.activation_layout.value
    w_layout = recipe.weight_granularity.value
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_sorted, bias)
    )
    if recipe.kernel != Kernel.EMULATED and not needs_grad:
        reason = grouped_unsupported_reason(
            x_sorted.device, x_sorted.dtype, act_dtype, w_fp8.dtype, a_layout, w_layout, n, k,
            num_experts,
        )  # fmt: skip
        if reason is None:
            rows = x_sorted[routing.token_index] if from_tokens else x_sorted
            return _scaled_grouped(
                rows, routing, w_fp8, w_scale, bias, act_dtype, a_layout, input_scale
            )

    plan = _plan(recipe)
    path = None if needs_grad else grouped_cpu.cpu_path(x_sorted, w_fp8, plan)
    if path is not None:
        return grouped_cpu.grouped_linear(
            None if from_tokens else x_sorted, routing, w_fp8, w_scale, bias, plan,
            input_scale, path, tokens=x_sorted if from_tokens else None,
        )  # fmt: skip
    if from_tokens:
        x_sorted = x_sorted[routing.token_index]
    pieces = []
    for expert, start, end in routing.present():
        pieces.append(
            fp8_linear(
                x_sorted[start:end],
                w_fp8[expert],
                w_scale[expert],
                None if bias is None else bias[expert].to(x_sorted.dtype),
                plan=plan,
                input_scale=None if input_scale is None else input_scale[expert : expert + 1],
            )
        )
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _static_grouped(
    x: torch.Tensor,
    routing: Routing,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    plan: LinearPlan,
    input_scale: torch.Tensor | None,
    from_tokens: bool,
) -> torch.Tensor:
    """The per-expert route for a static routing (``torch.compile``): every expert's
    ``fp8_linear`` runs on all rows (all token rows with ``from_tokens`` where a row's
    activation scale is its own, else all routed pairs) and keeps the rows routed to it
    (``torch.where``), so no size depends on the routing. Same numbers as the eager route:
    weight-only, per-token and block activation scales are row-local; a dynamic per-tensor
    activation scale is the amax of the expert's own rows, computed here on those rows and
    passed as a static scale; static scales are the expert's. Costs ``experts`` times the
    routed compute (``experts / top_k`` times with ``from_tokens``): the price of one graph.
    Dropped pairs (ids outside the experts) get zero rows.
    """
    num_experts, n, _ = w_fp8.shape
    group_scale = (
        plan.act_dtype is not None and not plan.static and plan.act_granularity == "tensor"
    )
    per_token = from_tokens and not group_scale
    rows = x if per_token or not from_tokens else x[routing.token_index]
    e_plan = dataclasses.replace(plan, static=True) if group_scale else plan
    out = rows.new_zeros(routing.expert_ids.shape[0], n)
    for expert in range(num_experts):
        mask = (routing.expert_ids == expert).unsqueeze(-1)
        e_scale = None if input_scale is None else input_scale[expert : expert + 1]
        if group_scale:
            group_amax = amax(rows.masked_fill(~mask, 0), "tensor")
            e_scale = amax_to_scale(group_amax, plan.act_dtype).reshape(1)
        y = fp8_linear(
            rows,
            w_fp8[expert],
            w_scale[expert],
            None if bias is None else bias[expert].to(rows.dtype),
            plan=e_plan,
            input_scale=e_scale,
        )
        if per_token:
            y = y.index_select(0, routing.token_index)
        out = torch.where(mask, y, out)
    return out
