"""compressed-tensors or vLLM ``fp8`` checkpoint → hf_fp8 checkpoint (same fp8 numbers)."""

from __future__ import annotations

import os
from pathlib import Path

from hf_fp8.config import Fp8Config
from hf_fp8.serialization.checkpoint import (
    Checkpoint,
    check_out_dir,
    copy_other_files,
    output_folder,
    resolve_checkpoint,
    rewrite_tensors,
    write_config,
)
from hf_fp8.serialization.experts import ExpertMerger, expert_modules, experts_view
from hf_fp8.serialization.formats import EXPORT_FORMATS, FORMATS, format_of
from hf_fp8.serialization.layers import build_meta_model, plan_layers
from hf_fp8.serialization.tensors import (
    check_complete,
    check_no_kv_cache_scales,
    check_scale_aliases,
    compute_dtype_of,
)
from hf_fp8.serialization.unfused_experts import (
    ExpertFuser,
    UnfusedExperts,
    find_unfused_experts,
    fused_view,
    has_unfused_candidates,
)


def _renamed(names, renames: dict[str, str]) -> list[str]:
    out = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        out.append(f"{module}.{renames.get(leaf, leaf)}")
    return out


def _unfused_experts(checkpoint: Checkpoint) -> dict[str, UnfusedExperts]:
    """Llama-4-style bmm experts stored one high-precision linear per expert (as a
    compressed-tensors export writes them), checked whole against the model the config builds;
    the model is only built when some tensor is named like a per-expert linear."""
    tensors = checkpoint.tensors()
    if not has_unfused_candidates(tensors):
        return {}
    return find_unfused_experts(build_meta_model(checkpoint.config, tensors), tensors)


def import_config(checkpoint: Checkpoint) -> tuple[str, Fp8Config]:
    """``(format name, Fp8Config)`` describing a foreign FP8 checkpoint's scheme."""
    fmt_name = format_of(checkpoint.quantization_config)
    if fmt_name == "hf_fp8":
        raise ValueError(
            f"{checkpoint.root} is already an hf_fp8 checkpoint: `import hf_fp8`, then "
            "from_pretrained loads it as is"
        )
    if fmt_name == "unquantized":
        raise ValueError(
            f"{checkpoint.root} is not quantized: quantize it with "
            "from_pretrained(..., quantization_config=hf_fp8.Fp8Config(...)) or hf-fp8 quantize"
        )
    if fmt_name not in FORMATS:
        raise ValueError(
            f"quant_method {fmt_name!r} is not supported: hf_fp8 imports {EXPORT_FORMATS} "
            "FP8 checkpoints"
        )
    kwargs = FORMATS[fmt_name].import_kwargs(checkpoint.quantization_config)
    return fmt_name, Fp8Config(**kwargs)


def import_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Convert an FP8 compressed-tensors (``float-quantized``) or vLLM ``fp8`` checkpoint
    (folder or Hub repo id) into an hf_fp8 checkpoint in ``out_dir``.

    fp8 weights are copied bit for bit; MoE experts stored one linear per expert (the
    ``fp8`` block checkpoints of Qwen3-MoE-FP8 / DeepSeek-V3) are merged into the fused
    ``[E, ...]`` tensors of ``Fp8Experts`` as transformers' conversion mapping says; Llama-4's
    experts kept in high precision, which a compressed-tensors export writes one linear per
    expert, become its fused ``gate_up_proj`` / ``down_proj`` again (the whole per-expert set
    checked first: every expert and projection, one dtype, the config's shapes, nothing fused
    or FP8 beside it). Scales become fp32 (exact) in hf_fp8's shapes. Every
    fp8 weight and scale is checked first (dtype, shape, finite, > 0): a bad one raises
    ``CheckpointTensorError`` naming it, and nothing is written. Then
    ``import hf_fp8; AutoModel…from_pretrained(out_dir)`` gives ``Fp8Linear`` layers with the
    same numbers. Unsupported variants (int8, fp4, asymmetric, KV-cache scales …) raise
    ``ValueError`` naming what is unsupported. Returns ``out_dir``.
    """
    src = Checkpoint(resolve_checkpoint(checkpoint))
    fmt_name, scheme = import_config(src)
    check_no_kv_cache_scales(src.tensors())  # all shards: an FP8 KV cache is refused
    unfused = _unfused_experts(src)
    tensors = fused_view(src.tensors(), unfused)
    tensors, groups = experts_view(src.config.get("model_type"), tensors)
    fmt = FORMATS[fmt_name]
    check_scale_aliases(tensors, fmt.import_renames)  # all shards, before any tensor is read
    plan = plan_layers(src.config, tensors, experts=expert_modules(groups))
    config = Fp8Config(
        scheme.activation_scheme,
        weight_granularity=scheme.weight_granularity,
        activation_granularity=scheme.activation_granularity,
        block_size=scheme.block_size,
        modules_to_not_convert=plan.modules_to_not_convert(),
    )
    check_complete(plan, _renamed(tensors, fmt.import_renames), config)
    out = check_out_dir(out_dir, source=src.root, overwrite=overwrite)
    with output_folder(out) as tmp:
        dtype = compute_dtype_of(src.config)
        merge = ExpertMerger(groups, config)  # per-expert fp8 linears -> Fp8Experts' names
        fuse = ExpertFuser(unfused)  # per-expert high-precision linears -> bmm experts' names

        def convert(shard):
            return merge(fmt.import_tensors(fuse(shard), plan, config, compute_dtype=dtype))

        rewrite_tensors(src, tmp, convert)
        merge.finish()
        fuse.finish()
        copy_other_files(src, tmp)
        write_config(tmp, {**src.config, "quantization_config": config.to_dict()})
    return out
