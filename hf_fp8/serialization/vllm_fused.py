"""The sibling linears vLLM stacks into one fused layer, for the export's checks.

vLLM loads several linears of one module as a single layer (its models'
``packed_modules_mapping`` and the ``stacked_params_mapping`` of their ``load_weights``): the
shards of one fused layer must share a scheme — all FP8 or all high precision — or it refuses
the checkpoint ("different quantization schemes for the shards of …"); with static activations
it serves the whole layer with one input scale, the largest of the shards'. Read from vLLM's
model files (``llama.py``, ``bert.py``, ``whisper.py``, ``deepseek_v2.py``, ``internlm2.py``,
``mixtral.py``), by the names transformers gives the shards:

========================  ===========================================  =========================
fused layer               shards (sibling linears of one module)       families
========================  ===========================================  =========================
``qkv_proj``              ``q_proj``, ``k_proj``, ``v_proj``           Llama, Mistral, Qwen2/3,
                                                                       Gemma, OPT, Phi, CLIP,
                                                                       Whisper (self-attention),
                                                                       DeepSeek without MLA …
``qkv_proj``              ``query``, ``key``, ``value``                BERT, RoBERTa, XLM-R only
                                                                       (vLLM serves no ViT, whose
                                                                       linears have these names)
``kv_proj``               ``k_proj``, ``v_proj``                       cross-attention (Whisper's
                                                                       ``encoder_attn``: its
                                                                       ``q_proj`` reads the
                                                                       decoder and stays alone)
``fused_qkv_a_proj``      ``q_a_proj``, ``kv_a_proj_with_mqa``         DeepSeek-V2/V3 MLA (with a
                                                                       ``q_lora_rank``)
``gate_up_proj``          ``gate_proj``, ``up_proj``                   Llama-style MLPs, the
                                                                       shared experts of
                                                                       Qwen2-MoE and DeepSeek
``gate_up_proj``          ``w1``, ``w3``                               InternLM2, Mixtral-style
                                                                       per-expert linears
========================  ===========================================  =========================

A group counts only where all its shards are linears of one module (DeepSeek without
``q_lora_rank`` has a lone ``kv_a_proj_with_mqa``, which vLLM does not fuse). Already fused
checkpoints (Phi-3's ``qkv_proj`` / ``gate_up_proj``, GPT-BigCode's ``c_attn``, GPT-NeoX's
``query_key_value``) hold one linear and need nothing. Not listed on purpose: DeepSeek-V3.2's
indexer ``wk`` + ``weights_proj`` (vLLM dequantizes an FP8 ``wk`` to fuse it with a
high-precision ``weights_proj``, so a mixed pair loads).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FusedShards:
    """One kind of fused layer: vLLM's name for it and the sibling linears it stacks."""

    fused: str
    shards: tuple[str, ...]
    # the ``model_type``s where vLLM fuses them; ``None``: every family with these names
    model_types: frozenset[str] | None = None


VLLM_FUSED_SHARDS: tuple[FusedShards, ...] = (
    FusedShards("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusedShards(
        "qkv_proj", ("query", "key", "value"), frozenset({"bert", "roberta", "xlm-roberta"})
    ),
    FusedShards("kv_proj", ("k_proj", "v_proj")),
    FusedShards("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
    FusedShards("gate_up_proj", ("gate_proj", "up_proj")),
    FusedShards("gate_up_proj", ("w1", "w3")),
)
# Modules whose query reads another sequence than their keys and values (cross-attention):
# vLLM fuses only k/v there (Whisper's ``encoder_attn.kv_proj``).
CROSS_ATTENTION = frozenset({"encoder_attn", "cross_attn", "crossattention"})


@dataclass(frozen=True)
class FusedGroup:
    """The shards of one fused layer found in a checkpoint."""

    parent: str  # the module holding the shards
    kind: FusedShards

    @property
    def fused(self) -> str:
        """vLLM's name of the fused layer, e.g. ``model.layers.0.self_attn.qkv_proj``."""
        return f"{self.parent}.{self.kind.fused}"

    @property
    def members(self) -> tuple[str, ...]:
        """The shards' module names, in vLLM's order."""
        return tuple(f"{self.parent}.{s}" for s in self.kind.shards)


def _kinds_for(parent: str, leaves: set[str], model_type: object) -> list[FusedShards]:
    found = [
        k
        for k in VLLM_FUSED_SHARDS
        if set(k.shards) <= leaves and (k.model_types is None or model_type in k.model_types)
    ]
    if parent.rpartition(".")[2] in CROSS_ATTENTION:
        found = [k for k in found if "q_proj" not in k.shards]
    # the largest group wins where one lies inside another (k/v inside q/k/v)
    return [k for k in found if not any(set(k.shards) < set(other.shards) for other in found)]


def fused_groups(modules: Iterable[str], model_type: object = None) -> list[FusedGroup]:
    """Every group of sibling linears among ``modules`` (module names) that vLLM stacks into
    one layer: all shards of a ``VLLM_FUSED_SHARDS`` kind (for ``model_type``, config.json's)
    under one parent, sorted by parent."""
    children: dict[str, set[str]] = {}
    for name in modules:
        parent, _, leaf = name.rpartition(".")
        children.setdefault(parent, set()).add(leaf)
    return [
        FusedGroup(parent, kind)
        for parent, leaves in sorted(children.items())
        for kind in _kinds_for(parent, leaves, model_type)
    ]
