"""Which layers of a checkpoint are FP8: the stock model's linear layers (built on the meta
device from ``config.json``) matched against the tensors that carry a ``weight_scale``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_fp8.modules import is_conv1d
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.serialization.checkpoint import FP8_DTYPE_NAMES, TensorInfo, module_of
from hf_fp8.serialization.experts import high_precision_experts

# Tensor leaves that only an FP8 layer has (hf_fp8's, compressed-tensors' and vLLM's names).
_SCALE_NAMES = frozenset({"weight_scale", "weight_scale_inv", "input_scale", "activation_scale"})


@dataclass(frozen=True)
class LayerPlan:
    """FP8 and high-precision linear layers of one checkpoint, by module name."""

    fp8: dict[str, tuple[int, int]]  # name -> (out_features, in_features) of the fp8 weight
    high_precision: list[str]  # linear layers of the stock model stored without fp8
    conv1d: list[str]  # GPT-2 style Conv1D layers of the stock model
    # MoE experts, one linear per expert and projection -> the experts module they belong to
    fp8_experts: dict[str, str] = field(default_factory=dict)  # (also in ``fp8``)
    high_precision_experts: dict[str, str] = field(default_factory=dict)
    # checkpoint name -> the module's name in transformers' model, where the two differ
    # (save_pretrained writes ViT's ``vit.layers.0.attention.q_proj`` as
    # ``vit.encoder.layer.0.attention.attention.query``)
    model_names: dict[str, str] = field(default_factory=dict)

    def ignored(self) -> list[str]:
        """Every linear the foreign formats must not quantize: the stock model's
        high-precision linears, then the high-precision per-expert linears (vLLM looks up
        ``<experts>.0.gate_proj`` … in ``ignore`` / ``ignored_layers``). A linear renamed on
        save is listed under both names: vLLM matches checkpoint names (through its own
        name mapper), transformers' compressed-tensors loader the model's module names."""
        names: list[str] = []
        for name in self.high_precision:
            names.append(name)
            if self.model_names.get(name, name) != name:
                names.append(self.model_names[name])
        return [*names, *sorted(self.high_precision_experts)]

    def modules_to_not_convert(self) -> list[str]:
        """hf_fp8's ``modules_to_not_convert`` for this plan (module names of the model, which
        the quantizer matches): the high-precision linears and the experts modules whose
        experts are stored in high precision."""
        return [
            *(self.model_names.get(n, n) for n in self.high_precision),
            *sorted(set(self.high_precision_experts.values())),
        ]


def registered_model_class(model_type: str, architecture: object) -> type | None:
    """The model class called ``architecture`` when transformers' auto mappings register it
    for ``model_type``; else ``None``. ``config.json`` never names code to run: a name is only
    looked up after the registry lists it, and the result must be a ``PreTrainedModel``."""
    if not isinstance(architecture, str):
        return None
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for attr, mapping in vars(modeling_auto).items():
        if attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            value = mapping.get(model_type)
            names.update([value] if isinstance(value, str) else value or ())
    if architecture not in names:
        return None
    cls = getattr(transformers, architecture, None)
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return cls
    return None


# config.json's words for the length of a layer stack (top level and nested sub-configs:
# text_config, vision_config, encoder / decoder …)
LAYER_COUNT_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)
# How many more layers than the tensors hold a config may describe and still be built: models
# that run one stored layer several times (ALBERT: 12 passes through albert_layers.0) or store
# a stack shorter than the count say are built as before; a count beyond this is refused.
LAYER_SLACK = 64
# Looped models run their stored layers several times and count every pass (HRM-text:
# layers per stack x H_cycles x (L_cycles + 1) = 8 x stored; R23 F2)
LAYER_RATIO = 16


def stored_layer_count(names: Iterable[str]) -> int:
    """The most layers one stack of the tensors ``names`` holds: the largest number of
    distinct indices under one name prefix (``model.layers.<i>``, ``….experts.<e>``).
    Distinct indices, not the largest index: one tensor named ``layers.19999`` holds one."""
    found: dict[str, set[int]] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                found.setdefault(".".join(parts[:i]), set()).add(int(part))
    return max((len(indices) for indices in found.values()), default=0)


def _layer_counts(config: Mapping[str, Any], where: str = "") -> Iterable[tuple[str, int]]:
    for key, value in config.items():
        if key == "quantization_config":
            continue
        if isinstance(value, Mapping):
            yield from _layer_counts(value, f"{where}{key}.")
        elif key in LAYER_COUNT_KEYS and isinstance(value, int) and not isinstance(value, bool):
            yield f"{where}{key}", value


def check_layer_counts(config: Mapping[str, Any], names: Iterable[str]) -> None:
    """Refuse (``ValueError`` naming the field, both counts and the fix) a config that
    describes far more layers (``LAYER_COUNT_KEYS``, nested sub-configs too) than the tensors
    ``names`` hold (``LAYER_RATIO`` x :func:`stored_layer_count` + ``LAYER_SLACK``): such a checkpoint is
    incomplete or its config is wrong, and building the model it describes on the meta device
    takes time and memory in proportion to the count, not to the files (R22: 170 s and
    1.1 GB for a 124 KB folder whose config said 20000 layers). Not truncated instead: per-layer structure can depend on the count (the last
    layer's bias in GPT-NeoX-Japanese, Gemma-4's KV-shared layers, Swin's stages)."""
    held = stored_layer_count(names)
    for field_name, count in _layer_counts(config):
        if count > LAYER_RATIO * held + LAYER_SLACK:
            raise ValueError(
                f"config.json's {field_name} is {count}, but the checkpoint's tensors hold "
                f"{held} layer(s) at most (distinct indices under one name, e.g. "
                "model.layers.<i>): the checkpoint is incomplete (a missing shard?) or its "
                "config.json was changed. Download the whole checkpoint again, or restore "
                f"{field_name} in config.json to what the model was saved with"
            )


def build_meta_model(
    config: dict[str, Any], tensor_names: Iterable[str] | None = None
) -> nn.Module:
    """The stock transformers model ``config`` describes, on the meta device (no weights;
    the architecture must be part of transformers). With the checkpoint's ``tensor_names``,
    a config describing far more layers than they hold is refused first
    (:func:`check_layer_counts`)."""
    if tensor_names is not None:
        check_layer_counts(config, tensor_names)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = config.get("model_type")
    if not model_type:
        raise ValueError("config.json has no model_type: cannot tell which layers are linear")
    try:
        hf_config = CONFIG_MAPPING[model_type].from_dict(config)
    except KeyError as err:
        raise ValueError(
            f"model_type {model_type!r} is not part of transformers {transformers.__version__}: "
            "hf_fp8 converts checkpoints of built-in architectures only (no remote code)"
        ) from err
    architectures = config.get("architectures") or []
    model_cls = registered_model_class(model_type, architectures[0]) if architectures else None
    with torch.device("meta"):
        if model_cls is not None:
            return model_cls(hf_config)
        return transformers.AutoModel.from_config(hf_config)


def stock_linear_layers(
    config: dict[str, Any], tensor_names: Iterable[str] | None = None
) -> dict[str, str]:
    """``{module name: "linear" | "conv1d"}`` of the model ``config`` describes (checked
    against ``tensor_names`` first when given, see :func:`build_meta_model`).

    Every ``nn.Linear`` (subclasses included), on purpose not ``modules.is_convertible``:
    the foreign formats' loaders quantize every linear that the ``ignore`` list does not name,
    so the high-precision list must also hold the linears hf_fp8 keeps by rule (routers …)."""
    return _linear_kinds(build_meta_model(config, tensor_names))


def _linear_kinds(model: nn.Module) -> dict[str, str]:
    return {
        name: "conv1d" if is_conv1d(module) else "linear"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) or is_conv1d(module)
    }


def save_names(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """``{module name: the name save_pretrained stores its weight under}`` for the modules
    ``names`` of ``model``: transformers' conversion mapping reversed, as
    ``revert_weight_conversion`` does for a model built from its config (no legacy renamings,
    no prefix changes). ViT's ``vit.layers.0.attention.q_proj`` is saved as
    ``vit.encoder.layer.0.attention.attention.query``. A module whose weight a converter merges
    or splits on save (no one-to-one name), and every module when transformers' mapping is not
    available, keeps its own name."""
    names = list(names)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_converters,
            apply_renamings,
        )

        conversions = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
        reverse = [c.reverse_transform() for c in conversions[::-1]]
        renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
        converters = [c for c in reverse if isinstance(c, WeightConverter)]
    except Exception:  # another transformers: names as they are
        return {name: name for name in names}
    out: dict[str, str] = {}
    for name in names:
        key = f"{name}.weight"
        try:
            if apply_converters(key, converters)[1] is not None:
                saved = key
            else:
                saved = apply_renamings(key, renamings)
        except Exception:
            saved = key
        out[name] = saved.removesuffix(".weight") if saved.endswith(".weight") else name
    return out


def saved_linear_layers(
    config: dict[str, Any], tensor_names: Iterable[str] | None = None
) -> dict[str, tuple[str, str]]:
    """``{checkpoint module name: (kind, module name in the model)}`` of the linears of
    :func:`stock_linear_layers`, named as the checkpoint names them: the model's own name when
    ``tensor_names`` hold tensors under it, else the name ``save_pretrained`` writes
    (:func:`save_names`)."""
    tensor_names = None if tensor_names is None else list(tensor_names)
    model = build_meta_model(config, tensor_names)
    kinds = _linear_kinds(model)
    saved = save_names(model, kinds)
    stored = set()
    if tensor_names is not None:
        stored = {name[:i] for name in tensor_names for i, c in enumerate(name) if c == "."}
    out: dict[str, tuple[str, str]] = {}
    for name, kind in kinds.items():
        on_disk = name if name in stored else saved[name]
        out.setdefault(on_disk, (kind, name))
    return out


def plan_layers(
    config: dict[str, Any],
    tensors: dict[str, TensorInfo],
    *,
    experts: Mapping[str, tuple[str, int, int]] | None = None,
) -> LayerPlan:
    """Match fp8 weights to the stock model's linear layers, under the names the checkpoint
    uses (:func:`saved_linear_layers`: the model's, or those ``save_pretrained`` writes); raise
    on any fp8 weight that is not a plain ``nn.Linear`` of that model (Conv1D, tensors renamed
    by other tools). ``experts`` names the
    per-expert linears of FP8 MoE experts (``serialization.experts.expert_modules``): they
    count as FP8 linears, never as high-precision ones. Experts stored per expert in high
    precision are found by name (``high_precision_experts``). A config describing far more
    layers than ``tensors`` hold is refused before the model is built
    (:func:`check_layer_counts`)."""
    experts = experts or {}
    saved = saved_linear_layers(config, tensors)
    stock = {name: kind for name, (kind, _) in saved.items()}
    stock.update(dict.fromkeys(experts, "expert"))
    fp8: dict[str, tuple[int, int]] = {}
    for name, info in tensors.items():
        module, leaf = module_of(name)
        if leaf != "weight" or info.dtype not in FP8_DTYPE_NAMES:
            continue
        kind = stock.get(module)
        if kind is None:
            raise ValueError(
                f"fp8 tensor {name} is not the weight of a linear layer of "
                f"{(config.get('architectures') or ['this model'])[0]}: only nn.Linear layers "
                "and the MoE experts that transformers' conversion mapping merges can be "
                "converted (renamed checkpoints cannot)"
            )
        if kind == "conv1d":
            raise ValueError(
                f"{module} is a GPT-2 style Conv1D in stock transformers (weight [in, out]); "
                "compressed-tensors and vLLM quantize nn.Linear layers only: keep this model in "
                "the hf_fp8 format"
            )
        if len(info.shape) != 2:
            raise ValueError(f"fp8 weight {name} must be 2-D, got shape {info.shape}")
        fp8[module] = (info.shape[0], info.shape[1])
    for name in tensors:
        module, leaf = module_of(name)
        if leaf in _SCALE_NAMES and module not in fp8:
            weight = tensors.get(f"{module}.weight")
            found = f"stored as {weight.dtype}" if weight is not None else "missing"
            raise CheckpointTensorError(
                f"{module}.weight: {found}, but the layer has a scale ({name}): a high-"
                "precision tensor cannot stand in for FP8 codes; the checkpoint is damaged or "
                "was written by another tool: re-export it"
            )
    if not fp8:
        raise ValueError("the checkpoint holds no fp8 weights: quantize it first (hf-fp8 quantize)")
    high = sorted(n for n, kind in stock.items() if kind == "linear" and n not in fp8)
    conv = sorted(n for n, kind in stock.items() if kind == "conv1d")
    hp_experts = high_precision_experts(config.get("model_type"), tensors)
    return LayerPlan(
        fp8=dict(sorted(fp8.items())),
        high_precision=high,
        conv1d=conv,
        fp8_experts={
            n: merged.rpartition(".")[0] for n, (merged, _, _) in experts.items() if n in fp8
        },
        high_precision_experts={n: m for n, m in hp_experts.items() if n not in fp8},
        model_names={n: m for n, (_, m) in sorted(saved.items()) if n != m},
    )
