"""MoE experts on disk: transformers' merged ``[E, ...]`` tensors ↔ per-expert linears.

hf_fp8 checkpoints hold the experts of an ``Fp8Experts`` module under transformers' merged
names (``mlp.experts.gate_up_proj`` fp8 ``[E, 2I, H]``, ``..._weight_scale`` ``[E, ...]``,
``..._input_scale`` ``[E]``); ``save_pretrained`` writes the codes back per expert (the
reverse of transformers' conversion mapping), the scales under the merged names. The
foreign formats (vLLM ``fp8`` as Qwen3-MoE-FP8 / DeepSeek-V3 ship, compressed-tensors as vLLM
reads) store one linear per expert and projection (``mlp.experts.3.gate_proj.weight``,
``weight_scale`` / ``weight_scale_inv``). Which per-expert names make which merged one is
transformers' own conversion mapping for the ``model_type`` (``MergeModulelist`` over the
experts, then ``Concatenate`` of the sources along the output rows): nothing is listed here.

:func:`experts_view` turns a checkpoint's headers into the per-expert view (one 2-D fp8
linear per expert and projection), so the format code handles experts like any linear;
:class:`ExpertMerger` merges per-expert hf_fp8 tensors into the merged names (import),
:func:`split_experts` does the reverse (export). Both work shard by shard.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_fp8.serialization.checkpoint import FP8_DTYPE_NAMES, TensorInfo

SCALE_LEAVES = ("weight_scale", "weight_scale_inv", "input_scale", "activation_scale")
_MERGED_SUFFIXES = ("_weight_scale", "_input_scale")


@dataclass(frozen=True)
class ExpertMerge:
    """One converter of transformers' mapping: per-expert ``sources`` (``*`` = expert index,
    ending in ``.weight``) concatenated along the output rows into ``target``."""

    sources: tuple[str, ...]
    target: str

    def stem(self, i: int, expert: int) -> str:
        return self.sources[i].removesuffix(".weight").replace("*", str(expert))

    def source_regex(self, i: int) -> re.Pattern[str]:
        stem = re.escape(self.sources[i].removesuffix(".weight")).replace(r"\*", r"(?P<e>\d+)")
        leaves = "|".join(("weight", *SCALE_LEAVES))
        return re.compile(rf"^(?P<prefix>.*?){stem}\.(?P<leaf>{leaves})$")

    def target_regex(self) -> re.Pattern[str]:
        suffixes = "|".join(_MERGED_SUFFIXES)
        return re.compile(rf"^(?P<prefix>.*?){re.escape(self.target)}(?P<suffix>{suffixes})?$")


def expert_merges(model_type: str | None) -> list[ExpertMerge]:
    """The per-expert → merged converters of transformers' mapping for ``model_type`` that
    are a plain merge (``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)`` for several
    sources); other converters (transposes, interleaves …) are not listed."""
    if not model_type:
        return []
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    merges = []
    for conv in get_checkpoint_conversion_mapping(model_type) or []:
        if not isinstance(conv, WeightConverter):
            continue
        sources = tuple(conv._original_source_patterns)
        targets = tuple(conv._original_target_patterns)
        ops = list(conv.operations)
        if len(targets) != 1 or not all("*" in s and s.endswith(".weight") for s in sources):
            continue
        plain = (
            ops
            and isinstance(ops[0], MergeModulelist)
            and ops[0].dim == 0
            and all(isinstance(op, Concatenate) and op.dim == 1 for op in ops[1:])
            and (len(ops) == 2) == (len(sources) > 1)
        )
        if plain:
            merges.append(ExpertMerge(sources, targets[0]))
    return merges


@dataclass
class ExpertGroup:
    """The per-expert tensors of one merged projection (``name`` = merged module.tensor)."""

    name: str
    merge: ExpertMerge
    prefix: str
    num_experts: int
    rows: list[int] = field(default_factory=list)  # output rows of each source

    def per_expert(self, i: int, expert: int) -> str:
        """Module name of source ``i`` of ``expert`` (``...experts.3.gate_proj``)."""
        return self.prefix + self.merge.stem(i, expert)


def _merged_groups(
    merges: list[ExpertMerge], tensors: dict[str, TensorInfo]
) -> tuple[dict[str, ExpertGroup], dict[str, TensorInfo]]:
    """Groups of merged fp8 expert tensors and the per-expert headers that stand for them."""
    groups: dict[str, ExpertGroup] = {}
    view: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        for merge in merges:
            m = merge.target_regex().match(name)
            if m is None or m["suffix"] or info.dtype not in FP8_DTYPE_NAMES:
                continue
            if len(info.shape) != 3 or info.shape[1] % len(merge.sources):
                raise ValueError(
                    f"{name}: merged fp8 experts must be [E, out, in], got {info.shape}"
                )
            e, n, k = info.shape
            rows = n // len(merge.sources)
            group = ExpertGroup(name, merge, m["prefix"], e, [rows] * len(merge.sources))
            groups[name] = group
            for i in range(len(merge.sources)):
                for expert in range(e):
                    view[f"{group.per_expert(i, expert)}.weight"] = TensorInfo(
                        info.dtype, (rows, k), info.file
                    )
    return groups, view


def experts_view(
    model_type: str | None, tensors: dict[str, TensorInfo]
) -> tuple[dict[str, TensorInfo], dict[str, ExpertGroup]]:
    """``(headers, expert groups)``: the headers with every fp8 expert tensor seen per expert
    and projection (merged codes and scales stand for their per-expert weights and scales),
    and the merged groups by merged name (found merged, or to be merged from per-expert fp8
    weights by :class:`ExpertMerger`)."""
    merges = expert_merges(model_type)
    if not merges:
        return dict(tensors), {}
    groups, view = _merged_groups(merges, tensors)
    found: dict[tuple[str, ExpertMerge], dict[int, dict[int, TensorInfo]]] = {}
    rest: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        if name in groups:
            continue
        rest[name] = info
        for merge in merges:
            for i in range(len(merge.sources)):
                m = merge.source_regex(i).match(name)
                if m and m["leaf"] == "weight" and info.dtype in FP8_DTYPE_NAMES:
                    found.setdefault((m["prefix"], merge), {}).setdefault(i, {})[int(m["e"])] = info
    for (prefix, merge), by_source in found.items():
        name = prefix + merge.target
        experts = sorted(by_source.get(0, {}))
        if len(by_source) != len(merge.sources) or any(
            sorted(by_source[i]) != experts for i in by_source
        ):
            raise ValueError(
                f"{name}: the checkpoint has fp8 expert weights for only some of "
                f"{merge.sources} or some experts: it is incomplete"
            )
        if experts != list(range(len(experts))):
            raise ValueError(f"{name}: expert indices {experts[:8]} are not 0..E-1")
        rows = [by_source[i][0].shape[0] for i in range(len(merge.sources))]
        groups[name] = ExpertGroup(name, merge, prefix, len(experts), rows)
    out = dict(view)
    leaves = {"_weight_scale": "weight_scale", "_input_scale": "input_scale"}
    for name, info in rest.items():
        merged = next(
            (
                (name.removesuffix(s), leaf)
                for s, leaf in leaves.items()
                if name.endswith(s) and name.removesuffix(s) in groups
            ),
            None,
        )
        if merged is None:
            out[name] = info
            continue
        group = groups[merged[0]]
        for i in range(len(group.merge.sources)):
            for e in range(group.num_experts):
                out[f"{group.per_expert(i, e)}.{merged[1]}"] = TensorInfo("F32", (1,), info.file)
    return out, groups


def model_name(model_type: str | None, key: str) -> str:
    """``key`` (a checkpoint tensor name) under the model's own module names: transformers'
    renamings for ``model_type`` applied (Mixtral's ``block_sparse_moe`` → ``mlp``,
    GraniteMoE's ``input_linear.weight`` → ``experts.gate_up_proj``); unchanged without any."""
    return model_names(model_type, [key])[key]


def model_names(model_type: str | None, keys: Iterable[str]) -> dict[str, str]:
    """``{key: model_name(model_type, key)}`` of many keys, transformers' mapping read once."""
    keys = list(keys)
    if not model_type:
        return {k: k for k in keys}
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [
        c
        for c in get_checkpoint_conversion_mapping(model_type) or []
        if isinstance(c, WeightRenaming)
    ]
    return {k: apply_renamings(k, renamings) if renamings else k for k in keys}


# leaves of the fused 3-D expert parameters of transformers' experts modules
_FUSED_LEAVES = ("gate_up_proj", "up_proj", "down_proj")


def high_precision_fused_tensors(
    model_type: str | None, tensors: dict[str, TensorInfo]
) -> dict[str, int]:
    """``{experts module (model's name): number of experts}`` of the experts stored fused in
    high precision: a 3-D floating tensor that is, under the model's names, a
    ``gate_up_proj`` / ``up_proj`` / ``down_proj`` parameter (not a linear's ``.weight``), as
    gpt-oss, Llama-4 and GraniteMoE (``input_linear.weight``) store their experts."""
    found: dict[str, int] = {}
    for name, info in tensors.items():
        if len(info.shape) != 3 or info.dtype in FP8_DTYPE_NAMES:
            continue
        owner, _, leaf = model_name(model_type, name).rpartition(".")
        if owner and leaf in _FUSED_LEAVES:
            found[owner] = max(found.get(owner, 0), int(info.shape[0]))
    return found


def high_precision_experts(
    model_type: str | None, tensors: dict[str, TensorInfo]
) -> dict[str, str]:
    """``{stored module: experts module}`` of the experts kept out of FP8, which the foreign
    formats' ignore lists must name and an import must keep in high precision (the experts
    module under the model's own names, for ``modules_to_not_convert``): expert linears
    stored one per expert (``block_sparse_moe.experts.3.w1.weight`` bf16 → ``mlp.experts``)
    and experts stored fused (:func:`high_precision_fused_tensors`, ``mlp.experts`` →
    itself)."""
    patterns = [
        (merge.source_regex(i), merge.target)
        for merge in expert_merges(model_type)
        for i in range(len(merge.sources))
    ]
    found: dict[str, str] = {}
    for name, info in tensors.items():
        if info.dtype in FP8_DTYPE_NAMES or not name.endswith(".weight"):
            continue
        for regex, target in patterns:
            m = regex.match(name)
            if m and m["leaf"] == "weight":
                merged = model_name(model_type, m["prefix"] + target)
                found[name.removesuffix(".weight")] = merged.rpartition(".")[0]
                break
    found.update({m: m for m in high_precision_fused_tensors(model_type, tensors)})
    return found


# vLLM asks about an MoE layer kept out of FP8 under these names: its compressed-tensors fused-MoE
# loader about ``<layer>.0.gate_proj`` / ``.0.up_proj`` / ``.0.down_proj`` (fixed names, whatever
# the family calls its projections), earlier versions about ``<layer>``; its ``fp8`` format
# skips ``<layer>`` when an ``ignored_layers`` entry containing "experts" contains it.
VLLM_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_PER_EXPERT = re.compile(r"^(?P<owner>.+)\.(?P<e>\d+)\.[^.]+$")


def vllm_ignore_names(layer: str, num_experts: int) -> list[str]:
    """What an ``ignore`` / ``ignored_layers`` list must hold for vLLM to keep the MoE layer
    ``layer`` (its checkpoint name) in high precision: the layer and, per expert, the three
    projection names vLLM asks about."""
    per_expert = (f"{layer}.{e}.{p}" for e in range(num_experts) for p in VLLM_EXPERT_PROJECTIONS)
    return [layer, *per_expert]


def _num_experts(module: nn.Module) -> int:
    for param in module.parameters(recurse=False):
        if param.dim() == 3:
            return int(param.shape[0])
    return int(getattr(module, "num_experts", 0) or 0)


def high_precision_fused_experts(
    model: nn.Module, tensors: dict[str, TensorInfo], per_expert: dict[str, str]
) -> dict[str, int]:
    """``{experts module: number of experts}`` of the experts modules of ``model`` (built from
    the checkpoint's config, e.g. on the meta device) that the checkpoint ``tensors`` hold in
    high precision and not one linear per expert: fused 3-D parameters (Llama-4, gpt-oss) or
    renamed ones (GraniteMoE's ``input_linear``). An experts module is FP8 on disk when a scale
    or an fp8 tensor is stored under its name (hf_fp8 keeps every experts scale there, also for
    experts whose codes are saved per expert), the stored names read as the model's
    (transformers' renamings: MiniMax and Mixtral store ``block_sparse_moe``, the model says
    ``mlp``, R9 4). ``per_expert`` (:func:`high_precision_experts`) lists those found per expert
    already."""
    from hf_fp8.modules import is_experts_module

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fp8_owners = set()
    for key, name in model_names(model_type, tensors).items():
        if "_scale" in name.rpartition(".")[2] or tensors[key].dtype in FP8_DTYPE_NAMES:
            parts = name.split(".")
            fp8_owners.update(".".join(parts[:i]) for i in range(1, len(parts)))
    covered = set(per_expert.values())
    found = {}
    for name, module in model.named_modules():
        if not name or name in covered or not is_experts_module(module):
            continue
        if name not in fp8_owners:
            found[name] = _num_experts(module)
    return found


def has_high_precision_3d(tensors: dict[str, TensorInfo]) -> bool:
    """Whether the checkpoint holds high-precision 3-D tensors (fused experts, or others such
    as convolutions): only then :func:`high_precision_fused_experts` needs the model."""
    return any(len(i.shape) == 3 and i.dtype not in FP8_DTYPE_NAMES for i in tensors.values())


def ignored_experts(per_expert: dict[str, str], fused: dict[str, int]) -> dict[str, str]:
    """``{name for ignore / ignored_layers: experts module}`` of every MoE layer the checkpoint
    holds in high precision, as vLLM matches it (:func:`vllm_ignore_names`): the layers of the
    per-expert linears ``per_expert`` (:func:`high_precision_experts`; Mixtral's are named
    ``w1`` / ``w2`` / ``w3``, which vLLM never asks about) and the ``fused`` experts modules
    (:func:`high_precision_fused_experts`)."""
    counts: dict[str, tuple[str, int]] = {}
    for name, owner in per_expert.items():
        m = _PER_EXPERT.match(name)
        if m:
            _, seen = counts.get(m["owner"], (owner, 0))
            counts[m["owner"]] = (owner, max(seen, int(m["e"]) + 1))
    counts.update({name: (name, n) for name, n in fused.items()})
    out: dict[str, str] = {}
    for layer, (owner, n) in counts.items():
        out.update(dict.fromkeys(vllm_ignore_names(layer, n), owner))
    return out


def transformers_unfused_experts(model: nn.Module, fused: dict[str, int]) -> dict[str, int]:
    """``{experts module: intermediate size}`` of the ``fused`` high-precision experts that
    stock transformers replaces by one MLP per expert when it loads a compressed-tensors
    checkpoint (its ``MODULES_TO_PATCH_FOR_QUANTIZATION``: ``Llama4TextExperts``) and whose
    layout hf_fp8 reads (``bmm_experts_layout``: ``gate_up_proj [E, H, 2I]`` gate first,
    ``down_proj [E, I, H]``). Written fused, transformers would find none of the per-expert
    weights it expects and initialise them at random."""
    from transformers.quantizers import base as quantizer_base

    from hf_fp8.modules.fp8_bmm_experts import bmm_experts_layout

    table = getattr(quantizer_base, "MODULES_TO_PATCH_FOR_QUANTIZATION", {})
    patched = {
        name
        for name, entry in table.items()
        if "compressed-tensors"
        in {str(getattr(m, "value", m)) for m in entry.get("quantization_methods", ())}
    }
    out = {}
    for name in fused:
        module = model.get_submodule(name)
        layout = bmm_experts_layout(module)
        if type(module).__name__ in patched and layout is not None:
            out[name] = layout.intermediate_size
    return out


def unfused_expert_name(owner: str, expert: int, projection: str) -> str:
    """The tensor name of one projection (``VLLM_EXPERT_PROJECTIONS``) of one expert of the
    bmm experts ``owner`` written one linear per expert: ``<owner>.<e>.gate_proj.weight``."""
    return f"{owner}.{expert}.{projection}.weight"


def unfuse_experts(
    tensors: dict[str, torch.Tensor], unfused: dict[str, int]
) -> dict[str, torch.Tensor]:
    """One shard with the ``unfused`` experts (:func:`transformers_unfused_experts`) written one
    linear per expert: ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj.weight``
    ``[out, in]``, the names llm-compressor writes and vLLM and transformers read.
    :func:`fuse_unfused_experts` is the reverse."""
    out = {}
    for key, value in tensors.items():
        owner, _, leaf = key.rpartition(".")
        inter = unfused.get(owner)
        if inter is None or leaf not in ("gate_up_proj", "down_proj"):
            out[key] = value
            continue
        for e in range(value.shape[0]):
            if leaf == "down_proj":
                out[unfused_expert_name(owner, e, "down_proj")] = value[e].t().contiguous()
            else:
                gate, up = value[e, :, :inter], value[e, :, inter:]
                out[unfused_expert_name(owner, e, "gate_proj")] = gate.t().contiguous()
                out[unfused_expert_name(owner, e, "up_proj")] = up.t().contiguous()
    return out


def fuse_unfused_experts(
    owner: str, num_experts: int, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The reverse of :func:`unfuse_experts` for the experts ``owner``: its per-expert
    ``gate_proj`` / ``up_proj`` ``[I, H]`` and ``down_proj`` ``[H, I]`` weights (all of them,
    checked by the caller) as the bmm layout's ``<owner>.gate_up_proj`` ``[E, H, 2I]`` (gate
    first) and ``<owner>.down_proj`` ``[E, I, H]``, bit for bit."""

    def weight(e: int, projection: str) -> torch.Tensor:
        return tensors[unfused_expert_name(owner, e, projection)].t()

    experts = range(num_experts)
    gate_up = [torch.cat([weight(e, "gate_proj"), weight(e, "up_proj")], dim=1) for e in experts]
    return {
        f"{owner}.gate_up_proj": torch.stack(gate_up).contiguous(),
        f"{owner}.down_proj": torch.stack([weight(e, "down_proj") for e in experts]).contiguous(),
    }


def expert_modules(groups: dict[str, ExpertGroup]) -> dict[str, tuple[str, int, int]]:
    """``{per-expert module: (merged name, source index, expert)}`` of every group."""
    return {
        g.per_expert(i, e): (name, i, e)
        for name, g in groups.items()
        for i in range(len(g.merge.sources))
        for e in range(g.num_experts)
    }


def _merge_scales(name: str, parts: list[torch.Tensor], granularity: str) -> torch.Tensor:
    """Scales of the sources of one expert, concatenated along the output rows (a per-tensor
    scale must be one number for all sources: Fp8Experts has one per expert)."""
    if granularity == "tensor":
        if any(not torch.equal(p, parts[0]) for p in parts[1:]):
            raise ValueError(
                f"{name}: the merged sources have different per-tensor scales "
                f"({[float(p.reshape(-1)[0]) for p in parts]}); Fp8Experts keeps one per expert "
                "and projection: re-quantize with per-row or block weight scales"
            )
        return parts[0]
    return torch.cat(parts, dim=0)


def _merge_input_scales(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One static input scale for the merged sources of one expert: their largest, as vLLM
    does for fused gate/up (``w13_input_scale.max()``). The sources of one merged projection
    read the same input (gate and up both read the hidden state), so the largest scale covers
    every source's calibrated amax without saturating; the others lose at most their ratio in
    precision. A difference is warned about (R27: the weight-scale advice made no sense here)."""
    merged = torch.stack([p.reshape(()) for p in parts]).max()
    low = min(float(p.reshape(-1)[0]) for p in parts)
    if float(merged) != low:
        warnings.warn(
            f"hf_fp8: {name}: the merged sources' static input scales differ "
            f"({[float(p.reshape(-1)[0]) for p in parts]}); they read the same input, so the "
            f"largest ({float(merged):g}) is kept, as vLLM does",
            UserWarning,
            stacklevel=2,
        )
    return merged


class ExpertMerger:
    """Shard-by-shard merge of per-expert hf_fp8 tensors (``weight``, ``weight_scale``,
    ``input_scale`` of each expert linear) into the merged names; a group is written into the
    shard where its last tensor arrives. :meth:`finish` raises if a group stayed incomplete."""

    def __init__(self, groups: dict[str, ExpertGroup], config: Any) -> None:
        self.groups = groups
        self.modules = expert_modules(groups)
        self.config = config
        self.pending: dict[str, dict[str, torch.Tensor]] = {name: {} for name in groups}

    def _needed(self, group: ExpertGroup) -> int:
        per = 2 + (1 if self.config.activation_scheme == "static" else 0)
        return per * len(group.merge.sources) * group.num_experts

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in tensors.items():
            module, _, leaf = key.rpartition(".")
            hit = self.modules.get(module)
            if hit is None or leaf not in ("weight", "weight_scale", "input_scale"):
                out[key] = value
                continue
            if key in self.pending[hit[0]]:  # two stored names of one tensor (import checks first)
                raise ValueError(
                    f"{key}: the checkpoint holds it twice (under two names, or in two shards): "
                    "nothing says which one is meant; keep one and re-export"
                )
            self.pending[hit[0]][key] = value
        for name, group in self.groups.items():
            got = self.pending[name]
            if got and len(got) == self._needed(group):
                out.update(self._merge(group, got))
                self.pending[name] = {}
        return out

    def _merge(self, group: ExpertGroup, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n_src = len(group.merge.sources)
        experts = range(group.num_experts)
        granularity = self.config.weight_granularity
        if granularity == "block" and n_src > 1:
            bn = self.config.block_size[0]
            if any(r % bn for r in group.rows):
                raise ValueError(
                    f"{group.name}: {group.rows} output rows per source are not a multiple of the "
                    f"weight block {bn}: the merged blocks would straddle the sources"
                )

        def per_expert(leaf: str, e: int) -> list[torch.Tensor]:
            return [got[f"{group.per_expert(i, e)}.{leaf}"] for i in range(n_src)]

        out = {
            group.name: torch.stack([torch.cat(per_expert("weight", e)) for e in experts]),
            f"{group.name}_weight_scale": torch.stack(
                [
                    _merge_scales(group.name, per_expert("weight_scale", e), granularity)
                    for e in experts
                ]
            ),
        }
        if self.config.activation_scheme == "static":
            out[f"{group.name}_input_scale"] = torch.stack(
                [_merge_input_scales(group.name, per_expert("input_scale", e)) for e in experts]
            )
        return out

    def finish(self) -> None:
        left = [name for name, got in self.pending.items() if got]
        if left:
            raise ValueError(f"incomplete fp8 experts in the checkpoint: {left[:4]}")


def fused_experts(tensors: dict[str, TensorInfo]) -> tuple[set[str], set[str]]:
    """``(codes, scales)``: the FP8 expert tensors of an hf_fp8 checkpoint stored fused,
    whatever their names — every 3-D fp8 tensor (a linear's weight is 2-D; ``Fp8Experts``
    stores ``[E, out, in]``) and every ``*_weight_scale`` / ``*_input_scale`` (an
    ``Fp8Linear``'s scales are ``.weight_scale`` / ``.input_scale``, after a dot). This
    covers what :func:`experts_view` cannot pair: families without a plain merge mapping
    (gpt-oss, Llama-4: stored fused) and renamed ones (GraniteMoE saves the codes as
    ``input_linear.weight``, the scales under the model's ``experts.gate_up_proj_*``)."""
    codes = {n for n, i in tensors.items() if i.dtype in FP8_DTYPE_NAMES and len(i.shape) == 3}
    scales = (
        {n for n in tensors if n.rpartition(".")[2].endswith(_MERGED_SUFFIXES)} if codes else set()
    )
    return codes, scales


def check_splittable(
    model_type: str | None, tensors: dict[str, TensorInfo], groups: dict[str, ExpertGroup]
) -> None:
    """Refuse (``ValueError`` naming the tensor) an export of fused FP8 experts that
    transformers' conversion mapping cannot split into per-expert linears (``model_type``
    without a plain merge: gpt-oss, Llama-4, GraniteMoE, JetMoE …): the foreign formats store
    one linear per expert, and written fused no loader would read them."""
    codes, _ = fused_experts(tensors)
    left = sorted(c for c in codes if c not in groups)
    if left:
        raise ValueError(
            f"{left[0]} (and {len(left) - 1} more): FP8 MoE experts stored fused [E, out, in]; "
            f"transformers' conversion mapping for model_type={model_type!r} names no "
            "per-expert linears to split them into, so an export would write tensors no "
            "loader reads. Keep the hf_fp8 checkpoint (from_pretrained loads it), or load it "
            "with Fp8Config(dequantize=True) for a high-precision copy"
        )


def merged_scale_names(groups: dict[str, ExpertGroup]) -> list[str]:
    """The merged scale names the expert groups may have (``..._weight_scale`` …)."""
    return [f"{name}{s}" for name in groups for s in _MERGED_SUFFIXES]


def _row_splits(group: ExpertGroup, height: int) -> list[slice]:
    """The rows (of codes, ``height`` 1) or block rows (of a block scale) of each source of
    ``group``; raises when a block holds rows of two sources: the per-expert linears would
    need the one scale each, and no per-expert scale grid reproduces the merged one."""
    starts = [sum(group.rows[:i]) for i in range(len(group.rows))]
    if any(s % height for s in starts):
        from math import gcd

        divisor = gcd(*group.rows)
        raise ValueError(
            f"{group.name}: its {height}-row weight blocks straddle the sources "
            f"{list(group.merge.sources)} (output rows {group.rows}): one block scale covers "
            "rows of two per-expert linears, so the merged scales cannot be split into the "
            "per-expert scales this format stores. Re-quantize with a block height that "
            f"divides {divisor} (Fp8Config(weight_granularity='block', block_size=[h, ...])) "
            "or with weight_granularity='row', or keep the hf_fp8 checkpoint"
        )
    return [
        slice(s // height, -(-(s + r) // height)) for s, r in zip(starts, group.rows, strict=True)
    ]


def check_split(groups: dict[str, ExpertGroup], config: Any) -> None:
    """Refuse (``ValueError`` naming the tensor and the fix) before anything is written when
    :func:`split_experts` cannot split a group's scales exactly."""
    if config.weight_granularity == "block":
        for group in groups.values():
            _row_splits(group, config.block_size[0])


def split_experts(
    tensors: dict[str, torch.Tensor], groups: dict[str, ExpertGroup], config: Any
) -> dict[str, torch.Tensor]:
    """The reverse of :class:`ExpertMerger` on one shard of an hf_fp8 checkpoint: merged
    codes and scales become per-expert ``weight`` / ``weight_scale`` / ``input_scale``.
    Block scales go to the source whose rows they cover (refused when a block straddles two
    sources, see :func:`check_split`); every per-expert tensor is checked to be there."""
    out = {}
    for key, value in tensors.items():
        base, suffix = key, ""
        for s in _MERGED_SUFFIXES:
            if key.endswith(s) and key.removesuffix(s) in groups:
                base, suffix = key.removesuffix(s), s
        group = groups.get(base)
        if group is None:
            out[key] = value
            continue
        n_src = len(group.merge.sources)
        one = suffix == "_input_scale" or (
            suffix == "_weight_scale" and config.weight_granularity == "tensor"
        )
        block = suffix == "_weight_scale" and config.weight_granularity == "block"
        splits = None if one else _row_splits(group, config.block_size[0] if block else 1)
        leaf = {"": "weight", "_weight_scale": "weight_scale", "_input_scale": "input_scale"}
        if value.shape[0] != group.num_experts:
            raise ValueError(
                f"{key}: {tuple(value.shape)} holds not one entry per expert "
                f"({group.num_experts}): the checkpoint is inconsistent, re-save it"
            )
        for e in range(group.num_experts):
            if splits is None:
                parts = [value[e].reshape(1)] * n_src
            else:
                parts = [value[e][rows] for rows in splits]
                want = [sl.stop - sl.start for sl in splits]
                if [p.shape[0] for p in parts] != want:
                    raise ValueError(
                        f"{key}: expert {e} has {value[e].shape[0]} rows, the sources "
                        f"{list(group.merge.sources)} need {sum(want)}: the checkpoint is "
                        "inconsistent, re-save it"
                    )
            for i, part in enumerate(parts):
                out[f"{group.per_expert(i, e)}.{leaf[suffix]}"] = part.clone()
    return out
