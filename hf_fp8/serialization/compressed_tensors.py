"""compressed-tensors ``float-quantized`` (what vLLM, SGLang and TGI load): config ↔ Fp8Config.

The tensors are hf_fp8's own (``weight`` fp8, ``weight_scale``, ``input_scale``, fp32); only
``config.json``'s ``quantization_config`` differs. Mapping of the schemes:

| hf_fp8 | compressed-tensors |
|---|---|
| weights ``tensor`` / ``row`` / ``block`` | ``strategy`` ``tensor`` / ``channel`` / ``block`` (+ ``block_structure``) |
| dynamic ``token`` / ``tensor`` | ``input_activations`` ``token`` / ``tensor``, ``dynamic: true`` |
| dynamic ``block`` (``1 × block_size[1]``) | ``group`` with ``group_size = block_size[1]``, ``dynamic: true`` |
| static ``tensor`` | ``tensor``, ``dynamic: false`` (``input_scale`` tensors) |
| weight-only | no ``input_activations`` |

compressed-tensors is not needed to write or read this format.

MoE experts: vLLM loads FP8 experts (one ``FusedMoE`` layer per experts module, matched by the
``Linear`` target) only as tensor weights with tensor activations, channel weights with
dynamic token activations, or block weights (``CompressedTensorsW8A8Fp8MoEMethod``); an export
of FP8 experts in any other pair is refused, and FP8 weight-only experts (which transformers
loads, vLLM does not) warn. Experts kept in high precision are listed in ``ignore`` as vLLM
matches them (``serialization.experts.vllm_ignore_names``).

Block weights with static activations: vLLM's block-FP8 paths quantize activations dynamically
in ``1 × k`` groups. Its fused-MoE method loads such experts and drops their input scales
(the served experts compute something else: refused); its linear method refuses the
checkpoint (transformers loads it: a warning).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hf_fp8.config import Fp8Config
from hf_fp8.recipe import Granularity
from hf_fp8.serialization.layers import LayerPlan
from hf_fp8.serialization.tensors import kv_cache_message, to_hf_fp8_tensors

QUANT_METHOD = "compressed-tensors"
FORMAT = "float-quantized"
# hf_fp8's own quantization_config key: the model's block size where the format keeps only its
# group size k (1 × k activation groups on non-block weights; vllm-fp8: on per-tensor
# weights). compressed-tensors, transformers and vLLM ignore unknown top-level keys.
BLOCK_SIZE_KEY = "hf_fp8_block_size"
_READ_FORMATS = ("float-quantized", "naive-quantized")
IMPORT_RENAMES: dict[str, str] = {}
# hf_fp8's weight granularities (hf_fp8.recipe) -> compressed-tensors' strategy words; every
# granularity must have one (checked at import), so a new one cannot be forgotten here.
_WEIGHT_STRATEGY = {
    Granularity.TENSOR: "tensor",
    Granularity.ROW: "channel",
    Granularity.BLOCK: "block",
}
if set(_WEIGHT_STRATEGY) != set(Granularity):
    raise RuntimeError("compressed_tensors._WEIGHT_STRATEGY misses a recipe.Granularity")


def _fp8_args(strategy: str, dynamic: bool, **extra: Any) -> dict[str, Any]:
    return {
        "num_bits": 8,
        "type": "float",
        "strategy": strategy,
        "dynamic": dynamic,
        "symmetric": True,
        **extra,
    }


# What vLLM's fused-MoE loader runs from an export with FP8 experts; the first is hf_fp8's
# dynamic default.
_MOE_RECIPES = (
    'Fp8Config("dynamic") (per-row weights, dynamic per-token activations)',
    'Fp8Config("static", weight_granularity="tensor")',
    'Fp8Config("dynamic", weight_granularity="tensor", activation_granularity="tensor")',
    'Fp8Config("dynamic", weight_granularity="block")',
)
# What vLLM runs instead of block weights with static activations (it has no such kernel).
BLOCK_STATIC_FIXES = (
    'Fp8Config("dynamic", weight_granularity="block") (block weights, dynamic 1 × k '
    'activation groups, what vLLM runs for block weights), or Fp8Config("static", '
    'weight_granularity="tensor") (static activations with per-tensor weights)'
)


def _vllm_moe_loads(weights: dict[str, Any], acts: dict[str, Any] | None) -> bool:
    """Whether vLLM's ``CompressedTensorsW8A8Fp8MoEMethod`` runs this FP8 pair as written
    (block weights only with dynamic activations: it drops static input scales)."""
    if acts is None:
        return False  # no FP8 weight-only fused-MoE method
    pair = (weights["strategy"], acts["strategy"])
    return (
        (weights["strategy"] == "block" and acts["dynamic"])
        or pair == ("tensor", "tensor")
        or (pair == ("channel", "token") and acts["dynamic"])
    )


def _where(modules: list[str]) -> str:
    return f"{modules[0]}" + (f" (and {len(modules) - 1} more)" if len(modules) > 1 else "")


def _check_block_static(plan: LayerPlan, group: dict[str, Any]) -> None:
    """Block weights with static activations: refused with FP8 experts (vLLM's fused MoE
    loads them and drops the input scales), a warning for linears (vLLM refuses them)."""
    acts = group.get("input_activations")
    if group["weights"]["strategy"] != "block" or acts is None or acts["dynamic"]:
        return
    hp = 'Fp8Config(..., modules_to_not_convert=["experts"])'
    if plan.fp8_experts:
        raise ValueError(
            "compressed-tensors export: block weights with static activations on FP8 experts "
            f"({_where(sorted(set(plan.fp8_experts.values())))}): vLLM's fused-MoE loader takes "
            "them but quantizes activations dynamically per 1 × k group and drops the static "
            "input scales, so the served experts would not compute what this checkpoint "
            f"holds. Quantize with {BLOCK_STATIC_FIXES}; or keep the experts in high precision "
            f"with {hp}; or keep the hf_fp8 checkpoint (from_pretrained loads it)"
        )
    warnings.warn(
        "compressed-tensors export: block weights with static activations load in "
        "transformers (compressed-tensors), but vLLM refuses them (its block FP8 linear takes "
        f"dynamic activations only). For vLLM, quantize with {BLOCK_STATIC_FIXES}",
        UserWarning,
        stacklevel=4,
    )


def _check_moe(config: Fp8Config, plan: LayerPlan, group: dict[str, Any]) -> None:
    """Refuse FP8 experts in a pair vLLM's fused-MoE loader asserts on; warn for weight-only."""
    if not plan.fp8_experts:
        return
    weights, acts = group["weights"], group.get("input_activations")
    if _vllm_moe_loads(weights, acts):
        return
    where = _where(sorted(set(plan.fp8_experts.values())))
    if acts is None:
        warnings.warn(
            f"compressed-tensors export: FP8 weight-only experts ({where}) load in "
            "transformers, not in vLLM's fused-MoE loader (it has no FP8 weight-only method)",
            UserWarning,
            stacklevel=3,
        )
        return
    act = "static" if not acts["dynamic"] else "dynamic"
    raise ValueError(
        f"compressed-tensors export: vLLM's fused-MoE loader refuses FP8 experts ({where}) with "
        f"{weights['strategy']} weights and {act} {acts['strategy']} activations; it loads "
        f"tensor+tensor, channel+dynamic token or block+dynamic. Quantize with "
        f"{'; '.join(_MOE_RECIPES)}; or keep the experts in high precision with "
        f'Fp8Config(..., modules_to_not_convert=["experts"]) (listed in the export\'s ignore); '
        f"or keep the hf_fp8 checkpoint (from_pretrained loads it)"
    )


def warn_dynamic_granularity(config: Fp8Config, export: str, *, stacklevel: int = 3) -> None:
    """Warn when vLLM quantizes this model's dynamic activations at another granularity than
    the model does (R33 F2): in ``1 × k`` groups for block weights (its block FP8 linear),
    per token for other weights (compressed-tensors' ``CompressedTensorsW8A8Fp8``: per tensor
    when static, else per token, whatever the ``strategy``). The checkpoint keeps the model's
    granularity for transformers and hf_fp8's compressed-tensors import."""
    if config.activation_scheme != "dynamic":
        return
    block = config.weight_granularity == "block"
    served = "block" if block else "token"
    if config.activation_granularity == served:
        return
    words = {
        "token": "per token",
        "tensor": "per tensor",
        "block": f"in 1 × {config.block_size[1]} groups",
    }
    fix = (
        'Fp8Config("dynamic", weight_granularity="block") (1 × k activation groups)'
        if block
        else 'Fp8Config("dynamic") (per-row weights) or Fp8Config("dynamic", '
        'weight_granularity="tensor"), both with per-token activations'
    )
    warnings.warn(
        f"{export} export: vLLM quantizes the dynamic activations of "
        f"{'block' if block else 'non-block'} FP8 weights {words[served]}, whatever the "
        f"checkpoint says; this model's are {words[config.activation_granularity]} "
        f"({config.activation_granularity!r}), so vLLM serves numbers a few % off this "
        f"model's. For vLLM's numbers quantize with {fix}",
        UserWarning,
        stacklevel=stacklevel,
    )


def export_config(config: Fp8Config, plan: LayerPlan) -> dict[str, Any]:
    """``quantization_config`` of the compressed-tensors export of an hf_fp8 model."""
    if config.fp8_format != "e4m3":
        raise ValueError(
            f"compressed-tensors stores FP8 as e4m3 only; this model is {config.fp8_format}: "
            "re-quantize with Fp8Config(fp8_format='e4m3')"
        )
    extra = (
        {"block_structure": list(config.block_size)} if config.weight_granularity == "block" else {}
    )
    group: dict[str, Any] = {
        "targets": ["Linear"],
        "weights": _fp8_args(_WEIGHT_STRATEGY[config.weight_granularity], False, **extra),
        "format": FORMAT,
    }
    if config.activation_scheme == "static":
        group["input_activations"] = _fp8_args("tensor", False)
    elif config.activation_scheme == "dynamic":
        if config.activation_granularity == "block":
            group_size = config.block_size[1]
            bad = [n for n, (_, k) in plan.fp8.items() if k % group_size]
            if bad:
                raise ValueError(
                    f"compressed-tensors group activations need in_features divisible by "
                    f"{group_size}; {bad[0]} is not: use a block_size that divides every layer"
                )
            group["input_activations"] = _fp8_args("group", True, group_size=group_size)
        else:
            group["input_activations"] = _fp8_args(config.activation_granularity, True)
    _check_block_static(plan, group)
    _check_moe(config, plan, group)
    qc: dict[str, Any] = {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": plan.ignored(),
        "kv_cache_scheme": None,
    }
    if _groups_on_non_block_weights(config):  # group_size holds only k of [rows, k]
        qc[BLOCK_SIZE_KEY] = list(config.block_size)
    return qc


def _groups_on_non_block_weights(config: Fp8Config | dict[str, Any]) -> bool:
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
    return (
        get("activation_scheme") == "dynamic"
        and get("activation_granularity") == "block"
        and get("weight_granularity") != "block"
    )


def export_tensors(
    tensors: dict[str, torch.Tensor], plan: LayerPlan, config: Fp8Config
) -> dict[str, torch.Tensor]:
    """Same names, dtypes and shapes as hf_fp8's: nothing to change."""
    return tensors


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"unsupported compressed-tensors checkpoint: {what}. hf_fp8 imports FP8 "
        "(type float, 8 bits, symmetric) float-quantized checkpoints with tensor, channel or "
        "block weights and token, tensor or group activations"
    )


_JSON_TYPES = {dict: "an object ({...})", list: "a list", str: "a string", bool: "true or false"}


def checked_type(value: Any, field: str, kind: type, *, optional: bool = False) -> Any:
    """``value`` when it is a ``kind`` (``None`` too when ``optional``); else ``ValueError``
    naming ``field`` of config.json's ``quantization_config`` and the JSON type expected
    (R33 F7: a list or a string gave a raw AttributeError, ``"false"`` read as true). A bool
    is not an int and an int is not a bool."""
    if optional and value is None:
        return value
    if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)):
        return value
    got = next((w for t, w in _JSON_TYPES.items() if type(value) is t), type(value).__name__)
    if value is None:
        got = "null"
    raise ValueError(
        f"config.json's quantization_config{'.' + field if field else ''} is {got} "
        f"({_short(value)}): expected "
        f"{_JSON_TYPES.get(kind, kind.__name__)}; the config is damaged or was written by "
        "another tool: fix it or re-export the checkpoint"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_args(args: dict[str, Any], role: str, where: str) -> None:
    for key in ("symmetric", "dynamic"):
        checked_type(args.get(key), f"{where}.{key}", bool, optional=True)
    checked_type(args.get("strategy"), f"{where}.strategy", str, optional=True)
    kind, bits = args.get("type"), args.get("num_bits")
    if kind != "float" or bits != 8:
        raise _unsupported(f"{role} are {kind} with {bits} bits (int8, fp4 … are not FP8)")
    if not args.get("symmetric", True):
        raise _unsupported(f"{role} are asymmetric")
    if args.get("scale_dtype") not in (None, "torch.float32", "torch.bfloat16", "torch.float16"):
        raise _unsupported(f"{role} scales are stored as {args['scale_dtype']}")


def checked_size(value: Any, field: str) -> int:
    """``value`` when it is an int >= 1 (not a bool); else ``ValueError`` naming ``field``
    of config.json's ``quantization_config``. Floats, bools and strings are refused, never
    rounded or converted (R22 F6: ``true`` imported as 1, 32.9 and ``"32"`` as 32)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(
        f"config.json's quantization_config.{field} is {value!r}: expected a whole number "
        "of elements >= 1 (an int, not a float, bool or string); the config is damaged or "
        "was written by another tool: fix it or re-export the checkpoint"
    )


def checked_block_size(value: Any, field: str) -> list[int]:
    """``value`` when it is ``[rows, cols]`` of two ints >= 1; else ``ValueError`` naming
    ``field`` of config.json's ``quantization_config``."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(
            f"config.json's quantization_config.{field} is {value!r}: expected "
            "[rows, cols] (two ints); the config is damaged: fix it or re-export the checkpoint"
        )
    return [checked_size(b, f"{field}[{i}]") for i, b in enumerate(value)]


def _group_kwargs(name: str, group: dict[str, Any]) -> dict[str, Any]:
    where = f"config_groups.{name}"
    checked_type(group, where, dict)
    weights = checked_type(group.get("weights"), f"{where}.weights", dict, optional=True)
    if not weights:
        raise _unsupported(f"config group {name} quantizes no weights")
    _check_args(weights, "weights", f"{where}.weights")
    if group.get("format") not in (None, *_READ_FORMATS):
        raise _unsupported(f"config group {name} has format {group['format']!r}")
    if group.get("output_activations"):
        raise _unsupported("output activations are quantized")
    strategy = weights.get("strategy")
    if weights.get("dynamic"):
        raise _unsupported("weights are dynamic")
    granularity = {v: k for k, v in _WEIGHT_STRATEGY.items()}.get(strategy)
    if granularity is None:
        raise _unsupported(f"weight strategy {strategy!r}")
    kwargs: dict[str, Any] = {"weight_granularity": granularity}
    block = weights.get("block_structure") or [128, 128]
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise _unsupported(f"{where}.weights.block_structure {block!r} is not [rows, cols]")
    block = [checked_size(b, f"{where}.weights.block_structure[{i}]") for i, b in enumerate(block)]
    acts_field = f"{where}.input_activations"
    acts = checked_type(group.get("input_activations"), acts_field, dict, optional=True)
    if not acts:
        kwargs["activation_scheme"] = "weight_only"
    else:
        _check_args(acts, "input activations", acts_field)
        a_strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
        if dynamic is True and a_strategy in ("token", "tensor"):
            kwargs.update(activation_scheme="dynamic", activation_granularity=a_strategy)
        elif dynamic is True and a_strategy == "group":
            size = checked_size(acts.get("group_size"), f"{where}.input_activations.group_size")
            if granularity == "block" and size != block[1]:
                raise _unsupported(f"group_size {size} differs from the weight block {block}")
            block = [block[0], size]
            kwargs.update(activation_scheme="dynamic", activation_granularity="block")
        elif dynamic is False and a_strategy == "tensor":
            kwargs.update(activation_scheme="static", activation_granularity="tensor")
        else:
            raise _unsupported(f"input activations {a_strategy!r} with dynamic={dynamic!r}")
    kwargs["block_size"] = block
    return kwargs


def import_kwargs(qc: dict[str, Any]) -> dict[str, Any]:
    """``Fp8Config`` keyword arguments (scheme part) of a compressed-tensors config."""
    checked_type(qc, "", dict)
    groups = checked_type(qc.get("config_groups"), "config_groups", dict, optional=True)
    if not groups:
        raise _unsupported("no config_groups")
    found = {name: _group_kwargs(name, group) for name, group in groups.items()}
    status = qc.get("quantization_status")
    if status != "compressed":
        raise _unsupported(f"quantization_status is {status!r}: weights are not stored in fp8")
    if qc.get("format") not in _READ_FORMATS and qc.get("format") != "mixed-precision":
        raise _unsupported(f"format {qc.get('format')!r}")
    if qc.get("kv_cache_scheme") is not None:  # {} too: the library reads an int8 scheme
        raise _unsupported(kv_cache_message(f"kv_cache_scheme={qc['kv_cache_scheme']!r}"))
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _unsupported(f"it has a {key}")
    first = next(iter(found.values()))
    if any(kw != first for kw in found.values()):
        raise _unsupported("config groups use different FP8 schemes (hf_fp8 has one per model)")
    recorded = qc.get(BLOCK_SIZE_KEY)
    if recorded is None:  # earlier hf_fp8 exports, other tools: [128, k] (rows unused)
        return first
    if not _groups_on_non_block_weights(first):
        raise ValueError(
            f"config.json's quantization_config.{BLOCK_SIZE_KEY}={recorded!r} goes with "
            "dynamic group activations on non-block weights only (block weights have "
            "block_structure): the config is damaged; fix it or re-export the checkpoint"
        )
    block = checked_block_size(recorded, BLOCK_SIZE_KEY)
    if block[1] != first["block_size"][1]:
        raise ValueError(
            f"config.json's quantization_config.{BLOCK_SIZE_KEY}={recorded!r} disagrees with "
            f"the activations' group_size {first['block_size'][1]} (it must be [rows, "
            "group_size]): the config is damaged; fix it or re-export the checkpoint"
        )
    return {**first, "block_size": block}


def import_tensors(
    tensors: dict[str, torch.Tensor],
    plan: LayerPlan,
    config: Fp8Config,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Scales to fp32 in hf_fp8's shapes; symmetric zero points dropped."""
    return to_hf_fp8_tensors(
        tensors,
        plan,
        config,
        zero_points=("weight_zero_point", "input_zero_point"),
        compute_dtype=compute_dtype,
    )
