"""Which layers of a checkpoint are FP8: the stock model's linear layers (built on the meta
device from ``config.json``) matched against the tensors that carry a ``weight_scale``."""

from __future__ import annotations

from collections.abc import Mapping
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

    def ignored(self) -> list[str]:
        """Every linear the foreign formats must not quantize: the stock model's
        high-precision linears, then the high-precision per-expert linears (vLLM looks up
        ``<experts>.0.gate_proj`` … in ``ignore`` / ``ignored_layers``)."""
        return [*self.high_precision, *sorted(self.high_precision_experts)]

    def modules_to_not_convert(self) -> list[str]:
        """hf_fp8's ``modules_to_not_convert`` for this plan: the high-precision linears and
        the experts modules whose experts are stored in high precision."""
        return [*self.high_precision, *sorted(set(self.high_precision_experts.values()))]


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


def build_meta_model(config: dict[str, Any]) -> nn.Module:
    """The stock transformers model ``config`` describes, on the meta device (no weights;
    the architecture must be part of transformers)."""
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


def stock_linear_layers(config: dict[str, Any]) -> dict[str, str]:
    """``{module name: "linear" | "conv1d"}`` of the model ``config`` describes.

    Every ``nn.Linear`` (subclasses included), on purpose not ``modules.is_convertible``:
    the foreign formats' loaders quantize every linear that the ``ignore`` list does not name,
    so the high-precision list must also hold the linears hf_fp8 keeps by rule (routers …)."""
    model = build_meta_model(config)
    return {
        name: "conv1d" if is_conv1d(module) else "linear"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) or is_conv1d(module)
    }


def plan_layers(
    config: dict[str, Any],
    tensors: dict[str, TensorInfo],
    *,
    experts: Mapping[str, tuple[str, int, int]] | None = None,
) -> LayerPlan:
    """Match fp8 weights to the stock model's linear layers; raise on any fp8 weight that is
    not a plain ``nn.Linear`` of that model (Conv1D, renamed tensors). ``experts`` names the
    per-expert linears of FP8 MoE experts (``serialization.experts.expert_modules``): they
    count as FP8 linears, never as high-precision ones. Experts stored per expert in high
    precision are found by name (``high_precision_experts``)."""
    experts = experts or {}
    stock = stock_linear_layers(config)
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
    )
