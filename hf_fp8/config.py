"""``Fp8Config``: the one FP8 recipe, for ``from_pretrained`` and ``quantize_model`` alike.

Strings in, one typed ``Fp8Recipe`` inside (``config.recipe``), plain JSON on disk.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import inspect
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers.utils.quantization_config import QuantizationConfigMixin

from hf_fp8.numerics import fp8_dtype
from hf_fp8.numerics.checks import input_scale_problem, max_scale
from hf_fp8.recipe import Fp8Recipe, Kernel, parse

QUANT_METHOD = "hf_fp8"

# Fields transformers may set on a loaded config: ``from_pretrained(fp8_dir,
# quantization_config=Fp8Config(dequantize=True))`` copies ``get_loading_attributes()`` onto
# the checkpoint's config with ``setattr`` (``AutoHfQuantizer.merge_quantization_configs``).
LOADING_ATTRIBUTES = ("dequantize", "kernel")
# Copied too when the passed config gives static scales: ``{"activation_scale": x,
# "activation_scales": {...}}`` for the layers whose input_scale a static checkpoint does not
# store (saved before calibration); stored ones are kept, the saved fields unchanged (R39 F3).
FILL_SCALES = "missing_input_scales"


class Fp8Config(QuantizationConfigMixin):
    """FP8 quantization recipe.

    Args:
        activation_scheme: ``"dynamic"`` (activation scale computed per call),
            ``"static"`` (scale given here or calibrated with ``hf_fp8.calibrate``) or
            ``"weight_only"``.
        weight_granularity: ``"row"`` (per output channel, default), ``"tensor"`` or
            ``"block"`` (``block_size`` tiles).
        activation_granularity: ``"token"`` (dynamic default), ``"tensor"`` (static
            default) or ``"block"`` (1 × ``block_size[1]``, dynamic default with block
            weights). ``None`` picks the default.
        fp8_format: ``"e4m3"`` (default) or ``"e5m2"``.
        block_size: ``[rows, cols]`` of a weight block (default ``[128, 128]``).
        modules_to_not_convert: module names (or dotted name parts) kept in high precision,
            on top of the default skips (output embeddings, tied weights, task heads outside
            the base model, ``_keep_in_fp32_modules``). A loaded model stores the resolved list here, so a
            saved checkpoint reloads exactly the layers it has (``[]``: all of them FP8).
        activation_scale: static scale used by every layer.
        activation_scales: static scales per module name (override ``activation_scale``);
            every value a positive number (leave a module out to give it ``activation_scale``).
        kernel: ``"auto"``, ``"scaled_mm"`` or ``"emulated"``.
        weight_scale_method: ``"absmax"`` (``amax / fp8_max``, default) or ``"mse"``
            (per-group clipping that minimises the weight's squared error; slower to
            quantize, same format on disk).
        dequantize: load an FP8 checkpoint back into high precision.

    The config is immutable after construction: build a variant with
    :meth:`replace`. Only the loading attributes ``dequantize`` and ``kernel`` may be
    assigned (transformers does so when ``from_pretrained`` gets a config for an FP8
    checkpoint); they are validated like the constructor's arguments. A passed config's
    ``activation_scale`` / ``activation_scales`` reach a static checkpoint's config aside from
    its fields (``fill_scales``): they fill only the input scales the checkpoint does not store.
    """

    def __init__(
        self,
        activation_scheme: str = "dynamic",
        *,
        weight_granularity: str = "row",
        activation_granularity: str | None = None,
        fp8_format: str = "e4m3",
        block_size: list[int] | tuple[int, int] = (128, 128),
        modules_to_not_convert: list[str] | None = None,
        activation_scale: float | None = None,
        activation_scales: dict[str, float] | None = None,
        kernel: str = "auto",
        weight_scale_method: str = "absmax",
        dequantize: bool = False,
        quant_method: str = QUANT_METHOD,
        **unknown: Any,
    ) -> None:
        if unknown:  # a typo or another library's field: name the closest one (R31 F13)
            raise TypeError(unknown_fields_message(sorted(unknown), "Fp8Config() got"))
        if quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        recipe = Fp8Recipe.resolve(
            activation_scheme,
            weight_granularity=weight_granularity,
            activation_granularity=activation_granularity,
            fp8_format=fp8_format,
            block_size=block_size,
            kernel=kernel,
            weight_scale_method=weight_scale_method,
        )
        scales = {
            "activation_scale": _scale(activation_scale, "activation_scale"),
            "activation_scales": _scales(activation_scales),
        }
        values = [scales["activation_scale"], *(scales["activation_scales"] or {}).values()]
        if not recipe.is_static and any(v is not None for v in values):
            raise ValueError(
                "activation_scale / activation_scales are only used with activation_scheme='static'"
            )
        _check_scale_bounds(scales, recipe)
        # The JSON fields are plain strings (the recipe's words); ``_recipe`` is not written.
        self.__dict__.update(
            quant_method=QUANT_METHOD,
            **recipe.to_strings(),
            modules_to_not_convert=module_names(modules_to_not_convert),
            **scales,
            dequantize=_bool(dequantize, "dequantize"),
            _recipe=recipe,
        )

    # -- immutability ----------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "kernel":
            kernel = parse(Kernel, value, "kernel")
            recipe = dataclasses.replace(self._recipe, kernel=kernel)
            # assigned: passed to from_pretrained (a loading attribute), not read from disk
            self.__dict__.update(kernel=kernel.value, _recipe=recipe, _kernel_assigned=True)
        elif name == "dequantize":
            self.__dict__["dequantize"] = _bool(value, "dequantize")
        elif name == FILL_SCALES:
            self._assign_fill_scales(value)
        elif name in self.__dict__:
            raise AttributeError(
                f"Fp8Config is immutable: build a new one with config.replace({name}=...) "
                f"(only the loading attributes {LOADING_ATTRIBUTES} may be assigned)"
            )
        else:
            super().__setattr__(name, value)

    def _assign_fill_scales(self, value: Any) -> None:
        """``from_pretrained(static_ckpt, quantization_config=Fp8Config("static",
        activation_scale=...))``: transformers assigns the passed config's scales (a loading
        attribute) on the checkpoint's config; validated as the constructor would, kept aside
        (not a JSON field): the quantizer gives them to the layers whose input_scale the
        checkpoint does not store, and warns."""
        if not isinstance(value, Mapping) or set(value) - {"activation_scale", "activation_scales"}:
            raise ValueError(
                f"{FILL_SCALES} must be a dict with the keys 'activation_scale' and / or "
                f"'activation_scales' (set by from_pretrained), got {value!r}"
            )
        given = " / ".join(k for k, v in value.items() if v is not None) or "activation_scale"
        if not self._recipe.is_static:
            raise ValueError(
                f"{given} was given to from_pretrained (Fp8Config('static', {given}=...)), but "
                "the checkpoint's quantization_config has "
                f"activation_scheme={self.activation_scheme!r}: static input scales apply to "
                "static checkpoints only (a passed config does not change the saved scheme). "
                "Load it without quantization_config; for static activations, load the "
                "high-precision checkpoint with Fp8Config('static', ...), or quantize_model it"
            )
        checked = self.replace(
            activation_scale=value.get("activation_scale"),
            activation_scales=value.get("activation_scales"),
        )
        self.__dict__["_fill_scales"] = {
            "activation_scale": checked.activation_scale,
            "activation_scales": checked.activation_scales,
        }

    @property
    def kernel_assigned(self) -> bool:
        """``kernel`` was assigned after construction: from_pretrained copied a passed
        config's kernel (a loading attribute) onto the checkpoint's config."""
        return self.__dict__.get("_kernel_assigned", False)

    @property
    def fill_scales(self) -> dict[str, Any] | None:
        """The static scales ``from_pretrained`` was given for the input scales the checkpoint
        does not store (``None``: none given)."""
        return self.__dict__.get("_fill_scales")

    def replace(self, **changes: Any) -> Fp8Config:
        """A new config with ``changes`` applied (validated like the constructor). A new
        ``activation_scheme`` or ``weight_granularity`` re-defaults ``activation_granularity``
        unless it is given too."""
        scheme_changed = {"activation_scheme", "weight_granularity"} & set(changes)
        if scheme_changed and "activation_granularity" not in changes:
            changes["activation_granularity"] = None
        return type(self)(**{**self.to_dict(), **changes})

    @property
    def recipe(self) -> Fp8Recipe:
        """The typed, validated scheme every layer of this config uses."""
        return self._recipe

    # -- JSON --------------------------------------------------------------------------------
    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The keys ``to_dict`` writes and ``from_dict`` accepts."""
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        return tuple(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs):
        """Build from a saved ``quantization_config``; a field this hf-fp8 does not know is
        named in the error, with the closest accepted field (a typo, another library's
        field) or, when none is close, the advice to upgrade (a newer hf-fp8 wrote it)."""
        known = cls.fields()
        unknown = sorted(set(config_dict) - set(known))
        if unknown:
            raise ValueError(unknown_fields_message(unknown, "quantization_config has"))
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in known}
        config_dict = _without_none_scales(config_dict)
        config = cls(**{**config_dict, **overrides})
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        """The JSON fields (plain strings, lists, numbers)."""
        return {k: _copy(v) for k, v in self.__dict__.items() if not k.startswith("_")}

    def __iter__(self):
        yield from self.to_dict().items()

    # -- per module ----------------------------------------------------------------------------
    def activation_scale_for(self, module_name: str) -> float | None:
        """The static activation scale given for ``module_name`` (``None``: calibrate)."""
        return (self.activation_scales or {}).get(module_name, self.activation_scale)

    def linear_kwargs(self, module_name: str = "") -> dict[str, Any]:
        """Keyword arguments of ``Fp8Linear`` for the module called ``module_name``."""
        return {
            "activation_scheme": self.activation_scheme,
            "weight_granularity": self.weight_granularity,
            "activation_granularity": self.activation_granularity,
            "fp8_format": self.fp8_format,
            "block_size": tuple(self.block_size),
            "kernel": self.kernel,
            "input_scale": self.activation_scale_for(module_name),
        }

    def get_loading_attributes(self) -> dict[str, Any]:
        """Fields a user may override when loading a saved FP8 checkpoint: ``dequantize``,
        ``kernel``, and the static scales when given (they fill only the input scales the
        checkpoint does not store)."""
        attributes = {name: getattr(self, name) for name in LOADING_ATTRIBUTES}
        if self.activation_scale is not None or self.activation_scales is not None:
            attributes[FILL_SCALES] = {
                "activation_scale": self.activation_scale,
                "activation_scales": _copy(self.activation_scales),
            }
        return attributes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fp8Config) and self.to_dict() == other.to_dict()

    __hash__ = None  # the loading attributes may still be assigned


# -- field checks: wrong types are refused, never converted (DESIGN §2.6) -----------------------
def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(
            f"{field} must be a bool (True or False), got {value!r} ({type(value).__name__}); "
            "in a config.json write true / false without quotes"
        )
    return value


def module_names(names: Any, option: str = "modules_to_not_convert") -> list[str] | None:
    """``None`` or a list / tuple of non-empty module names (``modules_to_not_convert``,
    ``quantize_model``'s ``skip``); ``option`` names the argument in the errors."""
    if names is None:
        return None
    if not isinstance(names, (list, tuple)):
        hint = f"; for one name write [{names!r}]" if isinstance(names, str) else ""
        raise ValueError(
            f"{option} must be a list of module names (str), e.g. ['lm_head'], "
            f"or None; got {names!r} ({type(names).__name__}){hint}"
        )
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name.strip():
            what = (
                "an empty name, which matches no module" if isinstance(name, str) else "not a str"
            )
            raise ValueError(
                f"{option}[{i}]={name!r} is {what}: the list holds module names "
                "(str), e.g. ['lm_head', 'model.layers.0.mlp']; remove or fix that entry"
            )
    return list(names)


def _scale(value: Any, field: str, *, optional: bool = True) -> float | None:
    """A static activation scale: a positive finite number (not a bool or str), or ``None``
    where ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        what = " or None" if optional else ""
        raise ValueError(
            f"{field} must be a positive finite number (a float, e.g. 0.05){what}, got "
            f"{value!r} ({type(value).__name__}); in a config.json write the number without "
            "quotes"
        )
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{field}={value!r}: activation scales must be positive finite numbers")
    return value


def _scales(scales: Any) -> dict[str, float] | None:
    """``activation_scales``: ``None`` or a dict of module name -> positive finite float."""
    if scales is None:
        return None
    if not isinstance(scales, Mapping):
        raise ValueError(
            "activation_scales must be a dict {module name: positive finite float}, e.g. "
            f"{{'model.layers.0.self_attn.q_proj': 0.05}}, or None; got {scales!r} "
            f"({type(scales).__name__}). One scale for every layer is activation_scale=..."
        )
    for key in scales:
        if not isinstance(key, str) or not key.strip():
            raise ValueError(
                f"activation_scales key {key!r} is not a module name: the keys are non-empty "
                "str, e.g. 'model.layers.0.self_attn.q_proj' (experts: '<experts>.down_proj')"
            )
    for key, value in scales.items():
        if value is None:
            # refused, not read as "use activation_scale" (R31 F5): a None entry is most often a
            # layer a calibration script found no scale for, which a silent fallback would hide;
            # the layer got no scale, ran nowhere and saved a checkpoint that could not reload
            raise ValueError(
                f"activation_scales[{key!r}] is None: every entry must be a positive finite "
                "number. Remove the entry to give that layer activation_scale (the scale for "
                "every layer not listed), give it its own number, or leave it out and set it "
                "with hf_fp8.calibrate(model, batches)"
            )
    return {
        k: _scale(v, f"activation_scales[{k!r}]", optional=False) for k, v in scales.items()
    } or None


def _without_none_scales(config_dict: dict[str, Any]) -> dict[str, Any]:
    """A saved config's ``activation_scales`` without ``None`` entries, which hf-fp8 before
    the twelfth session accepted and saved (R35): the layer's scale is in the checkpoint's
    tensors; ``Fp8Config(...)`` built by hand still refuses ``None`` (R31 F5)."""
    scales = config_dict.get("activation_scales")
    if not isinstance(scales, Mapping):
        return config_dict
    dropped = sorted(str(k) for k, v in scales.items() if v is None)
    if not dropped:
        return config_dict
    warnings.warn(
        f"quantization_config.activation_scales holds None for {dropped} (saved by an older "
        "hf-fp8): those entries are dropped; the layers take the input scales stored in the "
        "checkpoint (else activation_scale)",
        UserWarning,
        stacklevel=3,
    )
    kept = {k: v for k, v in scales.items() if v is not None}
    return {**config_dict, "activation_scales": kept or None}


def _check_scale_bounds(scales: dict[str, Any], recipe: Fp8Recipe) -> None:
    """Refuse static scales below ``min_input_scale`` of the recipe's fp8 format, or above
    ``max_scale`` for any compute dtype (2**64 / fp8_max: a model holding one could not be
    reloaded; a float16 layer's lower bound is checked when the scale is set on it)."""
    named = {"activation_scale": scales["activation_scale"]}
    named.update(
        (f"activation_scales[{k!r}]", v) for k, v in (scales["activation_scales"] or {}).items()
    )
    dtype = fp8_dtype(recipe.fp8_format)
    high = max_scale(dtype, torch.float32)
    for name, value in named.items():
        problem = None if value is None else input_scale_problem(name, value, dtype)
        if problem is None and value is not None and float(value) > high:
            problem = (
                f"{name}: {float(value):g} exceeds the largest input scale {high:.6g} "
                "(2**64 / fp8_max, the bound a checkpoint load accepts): a model holding it "
                "could not be reloaded. Give the activations' amax / fp8_max, or calibrate "
                "(hf_fp8.calibrate)"
            )
        if problem is not None:
            raise ValueError(problem)


# Fields of other FP8 configs that users copy over, with hf-fp8's words for them.
_KV_CACHE_FIELD = (
    "an FP8 KV-cache setting (compressed-tensors / vLLM): hf_fp8 does not quantize the KV "
    "cache; remove it from config.json's quantization_config to load the model with a "
    "high-precision KV cache."
)
_FOREIGN_FIELDS = {
    "weight_block_size": (
        "transformers' FineGrainedFP8Config field: here block_size=[rows, cols] with "
        "weight_granularity='block'."
    ),
    "kv_cache_scheme": _KV_CACHE_FIELD,
    "kv_cache_quant_method": _KV_CACHE_FIELD,
}


def unknown_fields_message(unknown: list[str], start: str) -> str:
    """Why ``unknown`` fields are refused: each one's closest accepted field (``difflib``),
    the accepted fields, and "upgrade hf-fp8" only for a field close to none of them."""
    known = Fp8Config.fields()
    by_lower = {k.lower(): k for k in known}
    hints, far = [], []
    for key in unknown:
        close = difflib.get_close_matches(str(key).lower(), list(by_lower), n=1, cutoff=0.6)
        if key in _FOREIGN_FIELDS:
            hints.append(f"{key!r} is {_FOREIGN_FIELDS[key]}")
        elif close:
            hints.append(f"{key!r}: did you mean {by_lower[close[0]]!r}?")
        else:
            far.append(key)
    text = f"{start} field(s) {unknown} that hf-fp8 {_version()} does not know. "
    if hints:
        text += " ".join(hints) + " "
    text += f"Fp8Config accepts: {', '.join(known)}."
    if far:
        text += (
            f" If {far} came from a checkpoint written by a newer hf-fp8, upgrade hf-fp8 "
            "(pip install -U hf-fp8) to load it; otherwise remove or rename it."
        )
    return text


def _version() -> str:
    try:
        return importlib.metadata.version("hf-fp8")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value
