"""Tensor-level conversions shared by the formats: scale names, dtypes and shapes.

hf_fp8 stores ``weight`` (fp8 ``[out, in]``), ``weight_scale`` (fp32 ``[1]``, ``[out, 1]`` or
``[ceil(out/bn), ceil(in/bk)]``) and ``input_scale`` (fp32 ``[1]``, static only), with
``high_precision ≈ fp8.float() * scale`` — the convention compressed-tensors and vLLM share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from hf_fp8.config import Fp8Config
from hf_fp8.modules.fp8_linear import weight_scale_shape
from hf_fp8.numerics.checks import (
    CheckpointTensorError,
    check_fp8_tensor,
    check_scale_tensor,
    max_scale,
    min_input_scale,
)
from hf_fp8.numerics.formats import FP8_DTYPES
from hf_fp8.serialization.checkpoint import module_of
from hf_fp8.serialization.layers import LayerPlan


def expected_weight_scale_shape(config: Fp8Config, out_in: tuple[int, int]) -> tuple[int, ...]:
    out_features, in_features = out_in
    return weight_scale_shape(
        out_features, in_features, config.weight_granularity, tuple(config.block_size)
    )


def compute_dtype_of(config: Mapping[str, object]) -> torch.dtype:
    """The dtype a checkpoint computes in (``config.json``'s ``dtype``), for scale bounds."""
    dtype = config.get("dtype") or config.get("torch_dtype")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(str(dtype), torch.float32)


def _fit(
    name: str,
    value: torch.Tensor,
    shape: tuple[int, ...],
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    compute_dtype: torch.dtype = torch.float32,
    min_value: float | None = None,
) -> torch.Tensor:
    """``value`` as fp32 of ``shape`` when it holds the same numbers (``[]`` → ``[1]``,
    ``[out]`` → ``[out, 1]``), checked finite, > 0 (``>= min_value`` when given: static input
    scales) and bounded (``numerics.checks``); raises ``CheckpointTensorError`` naming the
    tensor otherwise."""
    flat_ok = value.dim() <= 1 and (len(shape) == 1 or shape[-1] == 1)
    if tuple(value.shape) != shape and not (flat_ok and value.numel() == math.prod(shape)):
        raise CheckpointTensorError(
            f"{name}: has shape {tuple(value.shape)}, expected {shape} for this scheme: the "
            "checkpoint's config and its tensors disagree"
        )
    if not value.is_floating_point():
        raise CheckpointTensorError(f"{name}: is {value.dtype}, expected a floating-point scale")
    fitted = value.to(torch.float32).reshape(shape)
    return check_scale_tensor(
        name,
        fitted,
        shape=shape,
        max_value=max_scale(fp8_dtype, compute_dtype),
        min_value=min_value,
    )


def check_merged_weight_scale(
    name: str,
    value: torch.Tensor,
    codes_shape: tuple[int, int, int],
    config: Fp8Config,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight scale of merged expert codes ``[E, out, in]`` checked as stored, without
    splitting it per expert (a block may span two merged sources): shape
    ``[E, *scale_shape(out, in)]``, finite, > 0 and bounded; raises
    ``CheckpointTensorError`` naming it."""
    experts, out_features, in_features = codes_shape
    shape = (experts, *expected_weight_scale_shape(config, (out_features, in_features)))
    fp8_dtype = FP8_DTYPES[config.fp8_format]
    return _fit(name, value, shape, fp8_dtype=fp8_dtype, compute_dtype=compute_dtype)


def _check_bias(name: str, value: torch.Tensor, out_features: int) -> torch.Tensor:
    """An fp8 layer's bias: high precision (fp32 / bf16 / fp16) ``[out]``; an fp8 or integer
    bias raises ``CheckpointTensorError`` naming it (no FP8 kernel or loader reads one)."""
    if not value.is_floating_point() or value.dtype in FP8_DTYPES.values():
        raise CheckpointTensorError(
            f"{name}: the bias of an FP8 layer is {value.dtype}, expected a high-precision "
            "float (float32, bfloat16 or float16): FP8 layers keep their bias unquantized; "
            "re-save the checkpoint from the high-precision model"
        )
    if tuple(value.shape) != (out_features,):
        raise CheckpointTensorError(
            f"{name}: has shape {tuple(value.shape)}, expected ({out_features},)"
        )
    return value


def check_scale_aliases(names: Iterable[str], renames: Mapping[str, str]) -> None:
    """Refuse two stored tensors that are one hf_fp8 tensor once renamed (``renames``: leaf
    → leaf): vLLM's ``weight_scale`` next to transformers' ``weight_scale_inv``,
    ``input_scale`` next to ``activation_scale``. Keeping either would be a guess (the last
    name read won, silently: R22 F3); raises ``CheckpointTensorError`` naming both, before
    anything is written. Run on every name of a checkpoint (all shards, per-expert linears)."""
    seen: dict[str, str] = {}
    for name in sorted(names):
        module, _, leaf = name.rpartition(".")
        if leaf not in renames and leaf not in renames.values():
            continue
        target = f"{module}.{renames.get(leaf, leaf)}"
        other = seen.setdefault(target, name)
        if other != name:
            raise CheckpointTensorError(_alias_message(other, name, target))


# Scales of a quantized KV cache / attention (vLLM's and compressed-tensors' ``k_scale``,
# ``v_scale``, ``q_scale``, ``prob_scale``; AutoFP8's ``kv_scale`` and per-projection
# ``k_proj.output_scale``): hf_fp8 does not quantize the KV cache (R33 F1).
KV_CACHE_SCALES = frozenset(
    {"k_scale", "v_scale", "q_scale", "kv_scale", "prob_scale", "output_scale"}
)


# quantization_config keys of an FP8 KV cache (compressed-tensors', vLLM fp8's)
KV_CACHE_CONFIG_KEYS = ("kv_cache_scheme", "kv_cache_quant_method")


def kv_cache_message(what: str) -> str:
    """The refusal of an FP8 KV-cache checkpoint, ``what`` naming the tensors or config key."""
    return (
        f"{what}: this checkpoint quantizes the KV cache (FP8 KV cache / attention scales), "
        "and hf_fp8 does not quantize the KV cache: imported, the model would silently run "
        "with a high-precision KV cache, not what the checkpoint holds. Serve it as is (vLLM "
        "reads these scales). Only if a high-precision KV cache is acceptable: copy the "
        "checkpoint, delete the *.k_scale / *.v_scale / *.q_scale / *.kv_scale / "
        "*.prob_scale / *.output_scale tensors from its safetensors files "
        "(safetensors.torch.load_file, del, save_file) and kv_cache_scheme / "
        "kv_cache_quant_method from config.json's quantization_config, then import the copy"
    )


def check_no_kv_cache_scales(names: Iterable[str]) -> None:
    """Refuse KV-cache / attention scale tensors on any module (``KV_CACHE_SCALES``): raises
    ``CheckpointTensorError`` naming them and the fix. Run on every name of a checkpoint
    before anything is written."""
    found = sorted(n for n in names if n.rpartition(".")[2] in KV_CACHE_SCALES)
    if found:
        shown = ", ".join(found[:4]) + (f" (and {len(found) - 4} more)" if len(found) > 4 else "")
        raise CheckpointTensorError(kv_cache_message(shown))


def _alias_message(first: str, second: str, target: str) -> str:
    return (
        f"{first} and {second} are both the scale {target}: the checkpoint stores one scale "
        "under two names, and nothing says which one its writer meant. Keep one of them "
        "(re-export the checkpoint, or delete the other tensor)"
    )


def to_hf_fp8_tensors(
    tensors: Mapping[str, torch.Tensor],
    plan: LayerPlan,
    config: Fp8Config,
    *,
    renames: Mapping[str, str] | None = None,
    zero_points: Iterable[str] = (),
    compute_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Tensors of one shard in hf_fp8's layout: scales renamed (``renames``: leaf → leaf),
    cast to fp32 and reshaped; all-zero symmetric ``zero_points`` dropped; anything else on
    an fp8 layer is an error. Every fp8 weight and scale is checked (dtype, shape, finite,
    scales > 0 and bounded, static input scales ``>= min_input_scale``): a bad one raises
    ``CheckpointTensorError`` naming it; so do two names of one tensor (``weight_scale`` and
    ``weight_scale_inv``, see :func:`check_scale_aliases`)."""
    zero_points = set(zero_points)
    renames = renames or {}
    fp8_dtype = FP8_DTYPES[config.fp8_format]
    fit = {"fp8_dtype": fp8_dtype, "compute_dtype": compute_dtype}
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # target -> the stored name it came from
    for name, value in tensors.items():
        module, leaf = module_of(name)
        if module not in plan.fp8:
            out[name] = value
            continue
        leaf = renames.get(leaf, leaf)
        target = f"{module}.{leaf}"
        if source.setdefault(target, name) != name:
            first, second = sorted((source[target], name))
            raise CheckpointTensorError(_alias_message(first, second, target))
        if leaf == "weight":
            out[target] = check_fp8_tensor(name, value, dtype=fp8_dtype, shape=plan.fp8[module])
        elif leaf == "weight_scale":
            shape = expected_weight_scale_shape(config, plan.fp8[module])
            out[target] = _fit(name, value, shape, **fit)
        elif leaf == "input_scale":
            if config.activation_scheme != "static":
                raise ValueError(
                    f"{name} is a static activation scale, but the config says "
                    f"{config.activation_scheme!r} activations"
                )
            # the bound Fp8Linear's load applies: refused here, before a folder is written
            low = min_input_scale(fp8_dtype)
            out[target] = _fit(name, value, (1,), **fit, min_value=low)
        elif leaf in zero_points:
            if bool(value.ne(0).any()):
                raise ValueError(
                    f"{name} holds non-zero zero points: asymmetric FP8 is not supported "
                    "(hf_fp8 and vLLM's FP8 kernels are symmetric)"
                )
        elif leaf == "bias":
            out[name] = _check_bias(name, value, plan.fp8[module][0])
        elif leaf in KV_CACHE_SCALES:
            raise CheckpointTensorError(kv_cache_message(name))
        else:
            raise ValueError(
                f"unsupported tensor {name} on an FP8 layer: this variant (e.g. packed, "
                "grouped or global scales) is not FP8 float-quantized"
            )
    return out


def check_complete(plan: LayerPlan, names: Iterable[str], config: Fp8Config) -> None:
    """Every FP8 layer has a ``weight_scale`` (and an ``input_scale`` when static)."""
    names = set(names)
    needed = ["weight_scale"] + (["input_scale"] if config.activation_scheme == "static" else [])
    missing = [f"{m}.{leaf}" for m in plan.fp8 for leaf in needed if f"{m}.{leaf}" not in names]
    if missing:
        shown = ", ".join(missing[:4]) + (" …" if len(missing) > 4 else "")
        hint = (
            "calibrate the static model first (hf_fp8.calibrate / hf-fp8 calibrate)"
            if any(m.endswith("input_scale") for m in missing)
            else "the checkpoint is incomplete"
        )
        raise ValueError(f"{len(missing)} scale tensor(s) missing: {shown}; {hint}")
