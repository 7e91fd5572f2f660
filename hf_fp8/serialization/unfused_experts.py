"""Import of bmm experts (Llama-4's ``Llama4TextExperts``) stored one linear per expert.

A compressed-tensors export writes Llama-4's high-precision fused experts one linear per
expert (``experts.unfuse_experts``: ``<experts>.<e>.gate_proj`` / ``up_proj`` /
``down_proj.weight``), because stock transformers reads them so. An hf_fp8 checkpoint holds
them as the model's fused parameters (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``):
:func:`find_unfused_experts` checks the per-expert set against the model (every expert and
projection, one high-precision dtype, the model's shapes, nothing fused or FP8 beside it)
and :class:`ExpertFuser` fuses them shard by shard (``experts.fuse_unfused_experts``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.serialization.checkpoint import FP8_DTYPE_NAMES, TensorInfo
from hf_fp8.serialization.experts import (
    SCALE_LEAVES,
    VLLM_EXPERT_PROJECTIONS,
    fuse_unfused_experts,
    model_name,
    unfused_expert_name,
)

_PER_EXPERT = re.compile(
    rf"^(?P<owner>.+)\.(?P<e>\d+)\.(?P<proj>{'|'.join(VLLM_EXPERT_PROJECTIONS)})\.[^.]+$"
)
_FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")


@dataclass(frozen=True)
class UnfusedExperts:
    """One bmm experts module stored one linear per expert (``owner``: its stored name)."""

    owner: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    dtype: str  # safetensors dtype name of every per-expert weight

    def names(self) -> list[str]:
        """Every per-expert weight name, expert by expert."""
        return [
            unfused_expert_name(self.owner, e, p)
            for e in range(self.num_experts)
            for p in VLLM_EXPERT_PROJECTIONS
        ]

    def fused_view(self, file: str) -> dict[str, TensorInfo]:
        """The headers of the fused parameters the per-expert weights become."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return {
            f"{self.owner}.gate_up_proj": TensorInfo(self.dtype, (e, h, 2 * i), file),
            f"{self.owner}.down_proj": TensorInfo(self.dtype, (e, i, h), file),
        }


def _owners(tensors: dict[str, TensorInfo]) -> set[str]:
    return {m["owner"] for name in tensors if (m := _PER_EXPERT.match(name))}


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (and {len(names) - 4} more)" if len(names) > 4 else "")


def _check(owner: str, layout, tensors: dict[str, TensorInfo]) -> UnfusedExperts:
    """The per-expert set of ``owner`` checked against the model's ``layout``; raises
    ``CheckpointTensorError`` naming the tensors (never a partly random model)."""
    under = {n: i for n, i in tensors.items() if n.startswith(f"{owner}.")}
    mine = {n: m for n in under if (m := _PER_EXPERT.match(n)) and m["owner"] == owner}
    where = f"{owner} ({layout.source_class.__name__}, stored one linear per expert)"
    others = sorted(n for n in under if n not in mine)
    if others:
        raise CheckpointTensorError(
            f"{where}: the checkpoint also holds {_shown(others)} under it, beside per-expert "
            f"linears such as {min(mine)}: fused and per-expert experts mixed, the model "
            "cannot tell which to load; re-export it"
        )
    leaves = {n: n.rpartition(".")[2] for n in mine}
    fp8 = sorted(n for n in mine if under[n].dtype in FP8_DTYPE_NAMES or leaves[n] in SCALE_LEAVES)
    if fp8:
        raise CheckpointTensorError(
            f"{where}: {_shown(fp8)} are FP8 expert tensors (codes or scales); hf_fp8 imports "
            "Llama-4-style experts stored one linear per expert in high precision only "
            "(FP8 ones: keep the checkpoint for vLLM, or export from hf_fp8)"
        )
    other = sorted(n for n in mine if leaves[n] != "weight")
    if other:
        raise CheckpointTensorError(
            f"{where}: {_shown(other)}: the model's experts have no such tensor (only the "
            "weights of gate_proj / up_proj / down_proj); the checkpoint belongs to another model"
        )
    dtypes = {under[n].dtype for n in mine}
    if len(dtypes) != 1 or not dtypes <= set(_FLOAT_DTYPES):
        by = {d: min(n for n in mine if under[n].dtype == d) for d in sorted(dtypes)}
        raise CheckpointTensorError(
            f"{where}: the per-expert weights must share one floating dtype to form one fused "
            f"parameter, found {', '.join(f'{d} ({n})' for d, n in by.items())}"
        )
    want = UnfusedExperts(
        owner, layout.num_experts, layout.hidden_size, layout.intermediate_size, dtypes.pop()
    )
    expected = want.names()
    missing = [n for n in expected if n not in mine]
    extra = sorted(set(mine) - set(expected))
    if missing or extra:
        raise CheckpointTensorError(
            f"{where}: the model has {layout.num_experts} experts; "
            + (f"missing {_shown(missing)}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected {_shown(extra)}" if extra else "")
            + ": the checkpoint is incomplete or belongs to another config"
        )
    i, h = layout.intermediate_size, layout.hidden_size
    for name in expected:
        shape = (h, i) if mine[name]["proj"] == "down_proj" else (i, h)
        if tuple(under[name].shape) != shape:
            raise CheckpointTensorError(
                f"{name}: has shape {tuple(under[name].shape)}, expected {shape} for "
                f"{where} (hidden_size {h}, intermediate_size {i} in config.json)"
            )
    return want


def find_unfused_experts(
    model: nn.Module | None, tensors: dict[str, TensorInfo]
) -> dict[str, UnfusedExperts]:
    """``{stored experts name: UnfusedExperts}`` of the bmm experts modules of ``model`` (built
    from the checkpoint's config, e.g. on the meta device) stored one linear per expert, each
    checked whole (:func:`_check`). Names that are no bmm experts module of the model (Qwen3-MoE
    per-expert linears, which transformers' own conversion mapping merges) are left alone."""
    from hf_fp8.modules.fp8_bmm_experts import bmm_experts_layout

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    found = {}
    for owner in sorted(_owners(tensors)):
        module = _submodule(model, model_name(model_type, owner)) or _submodule(model, owner)
        layout = bmm_experts_layout(module) if module is not None else None
        if layout is not None:
            found[owner] = _check(owner, layout, tensors)
    return found


def has_unfused_candidates(tensors: dict[str, TensorInfo]) -> bool:
    """Whether any tensor is named like a per-expert linear (only then the model is needed)."""
    return bool(_owners(tensors))


def fused_view(
    tensors: dict[str, TensorInfo], groups: dict[str, UnfusedExperts]
) -> dict[str, TensorInfo]:
    """The headers with each group's per-expert weights replaced by its fused parameters."""
    out = dict(tensors)
    for group in groups.values():
        names = group.names()
        file = out[names[-1]].file
        for name in names:
            del out[name]
        out.update(group.fused_view(file))
    return out


class ExpertFuser:
    """Shard-by-shard fuse of the ``groups``' per-expert weights; a group is written into the
    shard where its last weight arrives. :meth:`finish` raises if one stayed incomplete."""

    def __init__(self, groups: dict[str, UnfusedExperts]) -> None:
        self.groups = groups
        self.owner_of = {n: g.owner for g in groups.values() for n in g.names()}
        self.pending: dict[str, dict[str, torch.Tensor]] = {o: {} for o in groups}

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in tensors.items():
            owner = self.owner_of.get(key)
            if owner is None:
                out[key] = value
            else:
                self.pending[owner][key] = value
        for owner, group in self.groups.items():
            got = self.pending[owner]
            if got and len(got) == len(group.names()):
                out.update(fuse_unfused_experts(owner, group.num_experts, got))
                self.pending[owner] = {}
        return out

    def finish(self) -> None:
        left = [owner for owner, got in self.pending.items() if got]
        if left:
            raise ValueError(f"incomplete per-expert high-precision experts: {left[:4]}")
