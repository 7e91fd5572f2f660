"""Where an FP8 layer came from, and so how to keep it in high precision instead.

Several refusals (peft ``modules_to_save`` / trainable tokens / methods other than LoRA on FP8
layers, LoRA on FP8 experts, a trainable copy of an FP8 layer) advise keeping the layer in high
precision. How depends on how the model was made:

* quantized on the fly from a high-precision checkpoint (``from_pretrained(...,
  quantization_config=Fp8Config(...))``) or by ``hf_fp8.quantize_model``: list the layer in
  ``Fp8Config(modules_to_not_convert=[...])`` / ``quantize_model(..., skip=[...])``;
* loaded from an FP8 checkpoint (pre-quantized): transformers uses the checkpoint's own
  ``quantization_config`` and only warns about the one passed, so ``modules_to_not_convert``
  there changes nothing. Load it in high precision (``Fp8Config(..., dequantize=True)``) and
  quantize it again with ``hf_fp8.quantize_model(..., skip=[...])``.

Either way the advice lists the layers the model already keeps (the checkpoint's saved
``modules_to_not_convert``, or the user's own skips) besides the new one: following it must
change that one layer and nothing else (R16 2). For an FP8 checkpoint the quantization again
uses absmax weight scales whatever the checkpoint's ``weight_scale_method``: the dequantized
weight of each group reaches exactly ``scale * fp8_max`` (an MSE-clipped group saturates
there), so absmax gives back the saved scale and codes; an MSE search would pick new ones.

The quantizer marks each FP8 module it builds (``mark_origin``, with those skips; the keys live
in the module's ``__dict__``: never saved, kept by ``copy.deepcopy``); :func:`how_to_keep` reads
the marks.

An ``Fp8Linear`` that replaced a GPT-2 style ``Conv1D`` (weight ``[in, out]``) records that
class too (:func:`mark_source_class`): dequantizing it (``model.dequantize()``,
``Fp8Config(dequantize=True)``, a LoRA merge) gives a ``Conv1D`` back (:func:`dense_layer`),
whose checkpoint reloads into the model's own class (R31: an ``nn.Linear`` there saved
``[out, in]`` tensors under GPT-2's ``[in, out]`` names).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

ORIGIN_KEY = "fp8_origin"
CHECKPOINT = "checkpoint"  # from_pretrained of an FP8 checkpoint (pre-quantized)
ON_THE_FLY = "on the fly"  # from_pretrained(high-precision checkpoint, quantization_config=...)
QUANTIZE_MODEL = "quantize_model"  # hf_fp8.quantize_model
SKIPS_KEY = "fp8_origin_skips"  # the skip patterns of the load / quantize_model call
DEFAULTS_KEY = "fp8_origin_default_skips"  # False: quantize again with default_skips=False
SOURCE_CLASS_KEY = "fp8_source_class"  # the GPT-2 style Conv1D class an Fp8Linear replaced


def _fp8_modules(module: nn.Module) -> list[nn.Module]:
    from hf_fp8.modules.fp8_experts import Fp8Experts
    from hf_fp8.modules.fp8_linear import Fp8Linear

    return [m for m in module.modules() if isinstance(m, (Fp8Linear, Fp8Experts))]


def mark_origin(
    model: nn.Module,
    origin: str,
    skips: Sequence[str] = (),
    *,
    default_skips: bool = True,
    update: bool = False,
) -> int:
    """Record ``origin`` and the skip patterns it was made with (``skips``: the checkpoint's
    ``modules_to_not_convert``, or the user's; ``default_skips=False``: a layer that
    ``quantize_model`` keeps by default is FP8 there) on every FP8 module of ``model`` that has
    none yet; return how many. ``update``: the FP8 modules marked already get ``skips`` and
    ``default_skips`` too (their origin stays): what the whole model keeps now (R18 F2)."""
    marked = 0
    for module in _fp8_modules(model):
        new = ORIGIN_KEY not in module.__dict__
        if new:
            module.__dict__[ORIGIN_KEY] = origin
            marked += 1
        if new or update:
            module.__dict__[SKIPS_KEY] = tuple(skips)
            module.__dict__[DEFAULTS_KEY] = default_skips
    return marked


def mark_source_class(new: nn.Module, module: nn.Module) -> None:
    """Record on ``new`` (the ``Fp8Linear`` replacing ``module``) that ``module`` is a GPT-2
    style ``Conv1D``, so that :func:`dense_layer` gives that class back; nothing for others."""
    from hf_fp8.modules.selection import is_conv1d

    if is_conv1d(module):
        new.__dict__[SOURCE_CLASS_KEY] = type(module)


def source_class(layer: nn.Module) -> type[nn.Module] | None:
    """The ``Conv1D`` class ``layer`` (an ``Fp8Linear``) replaced; ``None`` for a linear."""
    return layer.__dict__.get(SOURCE_CLASS_KEY)


def dense_layer(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cls: type[nn.Module] | None = None,
    *,
    weight_grad: bool = True,
    bias_grad: bool = True,
) -> nn.Module:
    """A high-precision layer holding ``weight`` (``[out, in]``, as ``Fp8Linear`` stores it)
    and ``bias``: an ``nn.Linear``, or with ``cls`` (:func:`source_class` of the FP8 layer) that
    ``Conv1D`` class, the weight transposed (``[in, out]``, contiguous, as a loaded GPT-2 holds
    it). Built on the meta device, its parameters set straight into ``_parameters`` (peft's
    ``init_empty_weights`` puts those set through ``register_parameter`` on meta: R30 F4)."""
    out_features, in_features = weight.shape
    with torch.device("meta"):
        if cls is None:
            dense = nn.Linear(in_features, out_features, bias is not None)
        else:
            dense = cls(out_features, in_features)  # Conv1D(nf, nx)
    if cls is not None:
        weight = weight.t().contiguous()
        if bias is None:  # Conv1D always adds one (a Conv1D source had one)
            bias = weight.new_zeros(out_features)
    dense._parameters["weight"] = nn.Parameter(weight, requires_grad=weight_grad)
    if bias is not None:
        dense._parameters["bias"] = nn.Parameter(bias, requires_grad=bias_grad)
    return dense


def origin_of(module: nn.Module) -> str | None:
    """The origin of ``module`` (an FP8 module, or a block holding some); ``None`` if unknown."""
    for part in _fp8_modules(module):
        origin = part.__dict__.get(ORIGIN_KEY)
        if origin is not None:
            return origin
    return None


def skips_of(module: nn.Module) -> list[str]:
    """The skip patterns ``module``'s FP8 layers were made with (``[]`` if unknown)."""
    for part in _fp8_modules(module):
        if ORIGIN_KEY in part.__dict__:
            return list(part.__dict__.get(SKIPS_KEY, ()))
    return []


def _skip_list(module: nn.Module, names: Sequence[str] | None) -> str:
    """The patterns the model already keeps, then ``names`` (``None``: ``...``)."""
    kept = skips_of(module)
    if names is None:
        return f"[{', '.join([*map(repr, kept), '...'])}]"
    return repr(list(dict.fromkeys([*kept, *names])))


def config_call(module: nn.Module, **extra: object) -> str:
    """``hf_fp8.Fp8Config(...)`` that rebuilds the recipe of ``module``'s FP8 layers (its
    activation scheme, and each setting that is not that scheme's default), plus ``extra``
    (an ``extra`` recipe setting replaces the layers' own)."""
    from hf_fp8.recipe import Fp8Recipe

    parts = _fp8_modules(module)
    recipe = getattr(parts[0], "recipe", None) if parts else None
    if recipe is None:
        args = ["..."]
    else:
        own = recipe.to_strings()
        words = {**own, **{k: v for k, v in extra.items() if k in own}}
        extra = {k: v for k, v in extra.items() if k not in own}
        default = Fp8Recipe.resolve(words["activation_scheme"]).to_strings()
        args = [repr(words["activation_scheme"])]
        args += [f"{k}={v!r}" for k, v in words.items() if v != default[k]]
    args += [f"{k}={v!r}" for k, v in extra.items()]
    return f"hf_fp8.Fp8Config({', '.join(args)})"


def how_to_keep(module: nn.Module, names: Sequence[str] | None) -> str:
    """How to keep the FP8 layer(s) ``module`` in high precision, for the model it came from:
    ``names`` are the patterns to list (``None``: ``...``), after the ones the model already
    keeps (``skips_of``). A clause that reads after "keep it in high precision: "."""
    listed = _skip_list(module, names)
    marked = [m for m in _fp8_modules(module) if ORIGIN_KEY in m.__dict__]
    defaults_off = ", default_skips=False" * (
        bool(marked) and marked[0].__dict__.get(DEFAULTS_KEY) is False
    )
    if origin_of(module) != CHECKPOINT and defaults_off:  # Fp8Config would keep lm_head (R18 F3)
        return (
            f"quantize with hf_fp8.quantize_model(model, config, skip={listed}{defaults_off}) "
            "(the layers it keeps already, then the new one)"
        )
    if origin_of(module) != CHECKPOINT:  # quantized from high precision here: the skip lists work
        return (
            f"load with hf_fp8.Fp8Config(..., modules_to_not_convert={listed}) or quantize with "
            f"hf_fp8.quantize_model(model, config, skip={listed}{defaults_off}) (the layers it "
            "keeps already, then the new one)"
        )
    static = any(
        getattr(getattr(m, "recipe", None), "is_static", False) for m in _fp8_modules(module)
    )
    calibrate = ", then calibrate it again (hf_fp8.calibrate): the static input scales are lost"
    requantize = config_call(module, weight_scale_method="absmax")  # gives the saved scales back
    return (
        "this model was loaded from an FP8 checkpoint, whose saved quantization_config wins over "
        "one passed to from_pretrained, so load that checkpoint in high precision, "
        f"from_pretrained(path, quantization_config={config_call(module, dequantize=True)}), and "
        f"quantize it again keeping the layer and the ones the checkpoint keeps: "
        f"hf_fp8.quantize_model(model, {requantize}, skip={listed}"
        f"{defaults_off}){calibrate * static}"
    )
