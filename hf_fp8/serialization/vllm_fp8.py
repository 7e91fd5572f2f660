"""vLLM's ``fp8`` format (AutoFP8 style, and DeepSeek-V3 style with weight blocks).

* per-tensor: ``{"quant_method": "fp8", "activation_scheme": "static" | "dynamic"}`` with
  scalar (shape ``[]``) fp32 ``weight_scale`` and, when static, ``input_scale``;
* blocks: ``weight_block_size: [bn, bk]``, scales in ``weight_scale_inv`` ``[ceil(out/bn),
  ceil(in/bk)]`` (despite the name, the same multiply-to-dequantize convention) and dynamic
  ``1 × bk`` activation groups. This variant is also what transformers' own ``fp8``
  (FineGrainedFP8) loads.

The format has no word for the granularity of dynamic activations: vLLM picks it per platform
for per-tensor weights (``Fp8LinearMethod``: per token where CUTLASS FP8 runs, i.e. FP8 NVIDIA
GPUs; per tensor elsewhere) and runs ``1 × k`` groups for block weights. hf_fp8 records its
model's in ``hf_fp8_activation_granularity`` (``"token"`` | ``"tensor"`` | ``"block"``; vLLM's
``Fp8Config.from_config`` and transformers' ``FineGrainedFP8Config`` read only the keys they
know) and reads it back: always for per-tensor weights, for block weights when it is not the
``1 × k`` groups the format implies (known gap 13.3: block weights with per-token activations
came back with groups). 1 × k groups on per-tensor weights also record the block size,
``hf_fp8_block_size: [rows, k]`` (the format has no ``weight_block_size`` there). Without the
key (AutoFP8 checkpoints) a dynamic import is per token for per-tensor weights, what vLLM runs
on the GPUs these checkpoints are made for, and ``1 × k`` groups for block weights. Per-row
weights and weight-only models have no place in this format: export those to
compressed-tensors.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hf_fp8.config import Fp8Config
from hf_fp8.serialization.checkpoint import module_of
from hf_fp8.serialization.compressed_tensors import (
    BLOCK_SIZE_KEY,
    BLOCK_STATIC_FIXES,
    checked_block_size,
    warn_dynamic_granularity,
)
from hf_fp8.serialization.layers import LayerPlan
from hf_fp8.serialization.tensors import (
    KV_CACHE_CONFIG_KEYS,
    kv_cache_message,
    to_hf_fp8_tensors,
)

QUANT_METHOD = "fp8"
# hf_fp8's own keys: the dynamic activation granularity, and the block size of 1 × k
# activation groups on per-tensor weights (BLOCK_SIZE_KEY, shared with compressed-tensors;
# vLLM and transformers ignore both)
GRANULARITY_KEY = "hf_fp8_activation_granularity"
_DYNAMIC_GRANULARITIES = ("token", "tensor", "block")
# what vLLM runs for a dynamic checkpoint without the key, on a GPU with CUTLASS FP8
_DEFAULT_DYNAMIC_GRANULARITY = "token"
# transformers' FineGrainedFP8 names → hf_fp8 names
IMPORT_RENAMES = {"weight_scale_inv": "weight_scale", "activation_scale": "input_scale"}


def export_config(config: Fp8Config, plan: LayerPlan) -> dict[str, Any]:
    """``quantization_config`` of the vLLM ``fp8`` export of an hf_fp8 model."""
    if config.fp8_format != "e4m3":
        raise ValueError(f"vLLM fp8 stores e4m3 only; this model is {config.fp8_format}")
    if config.activation_scheme == "weight_only":
        raise ValueError(
            "vLLM's fp8 format always quantizes activations; export a weight-only model with "
            "format='compressed-tensors'"
        )
    if config.weight_granularity == "row":
        raise ValueError(
            "vLLM's fp8 format stores one scale per weight tensor (or per block), not per row: "
            "export with format='compressed-tensors' (channel strategy), or quantize with "
            "Fp8Config(weight_granularity='tensor')"
        )
    qc: dict[str, Any] = {
        "quant_method": QUANT_METHOD,
        "activation_scheme": config.activation_scheme,
        "ignored_layers": plan.ignored(),
    }
    if config.weight_granularity == "block":
        if config.activation_scheme != "dynamic":
            raise ValueError(
                "vLLM's block fp8 format needs dynamic activations: vLLM has no kernel for "
                "block weights with static activation scales (its block FP8 paths quantize "
                "activations dynamically per 1 × k group) and refuses this checkpoint. Quantize "
                f"with {BLOCK_STATIC_FIXES}. format='compressed-tensors' holds this model for "
                "transformers, but vLLM cannot load it in compressed-tensors either"
            )
        bn, bk = config.block_size
        for name, (rows, cols) in plan.fp8.items():
            if rows % bn or cols % bk:
                raise ValueError(
                    f"vLLM's block fp8 format needs every FP8 layer divisible by the block: "
                    f"{name} is {rows}×{cols}, the block {bn}×{bk} (vLLM and transformers "
                    "cannot load it): export with format='compressed-tensors', or quantize "
                    "with a block_size that divides every layer"
                )
        qc["weight_block_size"] = list(config.block_size)
        # vLLM runs 1 × k activation groups with block weights: another granularity is
        # recorded for hf_fp8's import, and vLLM's numbers differ (the warning)
        if config.activation_granularity != "block":
            qc[GRANULARITY_KEY] = config.activation_granularity
        warn_dynamic_granularity(config, "vllm-fp8")
    elif config.activation_scheme == "dynamic":
        qc[GRANULARITY_KEY] = config.activation_granularity
        if config.activation_granularity == "block":
            qc[BLOCK_SIZE_KEY] = list(config.block_size)
        warnings.warn(
            f"vllm-fp8 export: vLLM picks the dynamic activation granularity per platform (per "
            f"token with CUTLASS FP8, else per tensor); this model's ({config.activation_granularity!r}) "
            f"is kept in quantization_config.{GRANULARITY_KEY} for hf_fp8's import",
            UserWarning,
            stacklevel=2,
        )
    return qc


def export_tensors(
    tensors: dict[str, torch.Tensor], plan: LayerPlan, config: Fp8Config
) -> dict[str, torch.Tensor]:
    """Per-tensor scales as scalars; block scales renamed to ``weight_scale_inv``."""
    out = {}
    for name, value in tensors.items():
        module, leaf = module_of(name)
        if module in plan.fp8 and leaf in ("weight_scale", "input_scale"):
            if config.weight_granularity == "block" and leaf == "weight_scale":
                out[f"{module}.weight_scale_inv"] = value
            else:
                out[name] = value.reshape(())
        else:
            out[name] = value
    return out


def import_kwargs(qc: dict[str, Any]) -> dict[str, Any]:
    """``Fp8Config`` keyword arguments (scheme part) of a vLLM / transformers fp8 config."""
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not 'static' or 'dynamic'")
    for key in KV_CACHE_CONFIG_KEYS:
        if qc.get(key) is not None:
            raise ValueError(kv_cache_message(f"fp8 quantization_config.{key}={qc[key]!r}"))
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3" or qc.get("scale_fmt", "float") != "float":
        raise ValueError(
            f"unsupported fp8 checkpoint (fmt={fmt!r}, scale_fmt={qc.get('scale_fmt')!r}): "
            "hf_fp8 imports e4m3 weights with float scales"
        )
    block = qc.get("weight_block_size")
    recorded = qc.get(GRANULARITY_KEY)
    group_block = qc.get(BLOCK_SIZE_KEY)
    if recorded is not None and recorded not in _DYNAMIC_GRANULARITIES:
        raise ValueError(
            f"fp8 {GRANULARITY_KEY} {recorded!r} is not one of {_DYNAMIC_GRANULARITIES}: "
            "the checkpoint's config.json is damaged; re-export it"
        )
    if recorded is not None and scheme != "dynamic":
        raise ValueError(
            f"fp8 {GRANULARITY_KEY}={recorded!r} goes with dynamic activations only, this "
            f"checkpoint is {scheme}: the config is damaged; re-export it"
        )
    if group_block is not None and (recorded != "block" or block is not None):
        raise ValueError(
            f"fp8 {BLOCK_SIZE_KEY}={group_block!r} goes with {GRANULARITY_KEY}='block' on "
            "per-tensor weights only (block weights have weight_block_size): the config is "
            "damaged; re-export it"
        )
    if block is None and scheme == "dynamic":
        granularity = _DEFAULT_DYNAMIC_GRANULARITY if recorded is None else recorded
        kwargs = {
            "activation_scheme": "dynamic",
            "weight_granularity": "tensor",
            "activation_granularity": granularity,
        }
        if granularity == "block":
            if group_block is None:
                raise ValueError(
                    f"fp8 {GRANULARITY_KEY}='block' (1 × k activation groups on per-tensor "
                    f"weights) without {BLOCK_SIZE_KEY}, the group size k (earlier hf_fp8 "
                    "exports wrote this): nothing says which k the model used. "
                    "Re-export the model with this hf_fp8, or, if per-token activations will "
                    f"do, delete {GRANULARITY_KEY} from config.json's quantization_config"
                )
            kwargs["block_size"] = checked_block_size(group_block, BLOCK_SIZE_KEY)
        return kwargs
    if block is None:
        return {
            "activation_scheme": "static",
            "weight_granularity": "tensor",
            "activation_granularity": "tensor",
        }
    block = checked_block_size(block, "weight_block_size")
    if scheme == "static":
        return {
            "activation_scheme": "static",
            "weight_granularity": "block",
            "activation_granularity": "tensor",
            "block_size": block,
        }
    return {
        "activation_scheme": "dynamic",
        "weight_granularity": "block",
        # vLLM's 1 × k groups unless the export recorded the model's own granularity
        "activation_granularity": "block" if recorded is None else recorded,
        "block_size": block,
    }


def import_tensors(
    tensors: dict[str, torch.Tensor],
    plan: LayerPlan,
    config: Fp8Config,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """``weight_scale_inv`` / ``activation_scale`` (transformers' names) renamed, scalars
    reshaped to ``[1]``, all scales fp32."""
    return to_hf_fp8_tensors(
        tensors, plan, config, renames=IMPORT_RENAMES, compute_dtype=compute_dtype
    )
