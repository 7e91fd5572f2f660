"""``quantize_model``: the one way to quantize a model that is already loaded."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence

from torch import nn
from transformers import PreTrainedModel

from hf_fp8.config import Fp8Config, module_names
from hf_fp8.modules import (
    Fp8Experts,
    Fp8Linear,
    check_activation_scales,
    convertible_modules,
    unconverted_linears,
    warn_unmatched,
)
from hf_fp8.modules.forward_ops import call_changes
from hf_fp8.modules.origin import (
    CHECKPOINT,
    DEFAULTS_KEY,
    ON_THE_FLY,
    ORIGIN_KEY,
    QUANTIZE_MODEL,
    SKIPS_KEY,
    mark_origin,
)
from hf_fp8.modules.replace import _build_experts, _build_linears, swapped_modules
from hf_fp8.modules.selection import ModuleFilter, inside_peft_layers, matches_module
from hf_fp8.quantizer.experts import experts_to_convert
from hf_fp8.quantizer.hf_quantizer import (
    POST_LOAD_HOOKS,
    Fp8HfQuantizer,
    default_skipped_modules,
)
from hf_fp8.recipe import Fp8Recipe


def mark_loaded_origin(model: nn.Module, hf_quantizer: object) -> None:
    """Post-load hook: mark the FP8 layers of a ``from_pretrained`` load as read from an FP8
    checkpoint or quantized on the fly (``hf_fp8.modules.origin``: a refusal that advises
    keeping a layer in high precision names the route that works for each). ``quantize_model``
    marks its layers before it runs the hooks."""
    pre_quantized = getattr(hf_quantizer, "pre_quantized", False)
    skips = list(getattr(hf_quantizer, "modules_to_not_convert", None) or ())  # the load's
    defaults = default_skipped_modules(model)
    if not pre_quantized:  # the user's own skips: the defaults come back with any new load
        mark_origin(model, ON_THE_FLY, [s for s in skips if s not in defaults])
        return
    fp8 = (n for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp8Experts)))
    # the checkpoint's saved list, as it is; a default-skipped layer stored FP8 (saved by
    # quantize_model(default_skips=False)) needs default_skips=False to be quantized again
    defaults_on = not any(matches_module(name, defaults) for name in fp8)
    mark_origin(model, CHECKPOINT, skips, default_skips=defaults_on)


if mark_loaded_origin not in POST_LOAD_HOOKS:  # imported with hf_fp8.quantizer, before any load
    POST_LOAD_HOOKS.append(mark_loaded_origin)


_PEFT_INNER = re.compile(r"\.(base_layer|original_module)$")  # peft's wrapped layer


def _kept_now(model: nn.Module, asked: Sequence[str]) -> tuple[list[str], bool]:
    """What ``quantize_model(high_precision_model, config, skip=names,
    default_skips=defaults)`` must be given to rebuild ``model`` as it is now: ``asked`` (this
    call's skips) where they keep no FP8 layer, then the name of each other high-precision
    layer that would convert (kept by a ``module_filter_fn``, or by an earlier call), the
    default skips aside unless one of them is FP8 (``default_skips=False``) (R18 F1, F2)."""
    root = _transformers_model(model) or model  # names a fresh from_pretrained model has
    fp8 = [n for n, m in root.named_modules() if isinstance(m, (Fp8Linear, Fp8Experts))]
    defaults = default_skipped_modules(root)
    defaults_on = not any(matches_module(name, defaults) for name in fp8)
    patterns = [p for p in asked if not any(matches_module(name, [p]) for name in fp8)]
    high = [n for n, *_ in convertible_modules(root)] + [n for n, *_ in experts_to_convert(root)]
    high = [_PEFT_INNER.sub("", n) for n in high]  # q_proj.base_layer: q_proj in a fresh model
    kept = [n for n in high if not matches_module(n, patterns)]
    if defaults_on:
        kept = [n for n in kept if not matches_module(n, defaults)]
    return list(dict.fromkeys([*patterns, *kept])), defaults_on


class AlreadyQuantizedError(ValueError):
    """``quantize_model`` was given a model that already holds FP8 layers."""


def _layout(recipe: Fp8Recipe) -> tuple:
    """What must agree between layers saved under one config (not the kernel choice nor how
    the weight scales were searched)."""
    return (
        recipe.activation_scheme,
        recipe.weight_granularity,
        recipe.activation_granularity,
        recipe.fp8_format,
        recipe.block_size,
    )


def _check_existing_fp8(model: nn.Module, config: Fp8Config) -> None:
    for name, module in model.named_modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)) and _layout(module.recipe) != _layout(
            config.recipe
        ):
            theirs = module.recipe.to_strings()
            ours = config.recipe.to_strings()
            diff = {k: (theirs[k], ours[k]) for k in theirs if theirs[k] != ours[k]}
            raise AlreadyQuantizedError(
                f"the model already has FP8 layers with another scheme (e.g. {name!r}: "
                + ", ".join(f"{k}={a!r} there, {b!r} asked" for k, (a, b) in diff.items())
                + "). One saved config must describe every layer: quantize with the same "
                "scheme, load the high-precision checkpoint, or dequantize first "
                "(model.dequantize() on a transformers model)."
            )


def _refuse_changed_calls(named: list[tuple[str, nn.Module]]) -> None:
    """``ValueError`` before anything converts when a layer to swap carries hooks or a
    patched call (``call_changes``): the FP8 layer that replaces it would drop them."""
    changed = [(name, what) for name, module in named if (what := call_changes(module))]
    if changed:
        listed = "; ".join(f"{name}: {', '.join(what)}" for name, what in changed[:5])
        more = f" (and {len(changed) - 5} more)" if len(changed) > 5 else ""
        raise ValueError(
            f"hf_fp8.quantize_model: {len(changed)} layer(s) to convert carry hooks or a patched "
            f"call that the FP8 layer replacing them would lose: {listed}{more}. Quantize "
            "before registering hooks (before accelerate's dispatch_model / "
            "cpu_offload, or load with from_pretrained(..., quantization_config=Fp8Config(...))), "
            "remove them, or keep these layers with skip=[...]"
        )


def _refuse_peft_layers(model: nn.Module, names: list[str]) -> None:
    """``ValueError`` before anything converts when a layer to convert is the base of a peft
    adapter layer (``get_peft_model`` ran first): the FP8 layer would sit under peft's own
    layer, not hf_fp8's ``Fp8LoraLinear``, past every FP8 check of ``get_peft_model``."""
    owners = inside_peft_layers(model, names)
    if not owners:
        return
    layers = list(dict.fromkeys(owners.values()))
    modules = dict(model.named_modules(remove_duplicate=False))

    def kind(name: str) -> str:
        cls = type(modules[name])
        parts = cls.__module__.split(".")
        tuner = parts[2] if parts[:2] == ["peft", "tuners"] and len(parts) > 2 else cls.__module__
        return f"{name} (peft {tuner}.{cls.__name__})"

    listed = ", ".join(kind(n) for n in layers[:5])
    more = f" (and {len(layers) - 5} more)" if len(layers) > 5 else ""
    leaves = list(dict.fromkeys(n.rpartition(".")[2] for n in layers))
    merge = (  # a PeftModel / PeftMixedModel; not a model that inject_adapter_in_model changed
        "merge the adapters first: model = model.merge_and_unload(), then "
        "hf_fp8.quantize_model(model, config); or "
        if callable(getattr(model, "merge_and_unload", None))
        else ""
    )
    raise ValueError(
        f"hf_fp8.quantize_model: {len(layers)} layer(s) to convert hold peft adapters: "
        f"{listed}{more}. Converting their base layers under peft's own layers would skip "
        "every FP8 check of get_peft_model: peft reads and merges a base weight as numbers, "
        "here fp8 codes without their scales (DoRA and HRA outputs silently wrong, merges that "
        "fail or rewrite the codes). Nothing was converted. Either quantize first and add the "
        "adapters afterwards: hf_fp8.quantize_model(base_model, config), then "
        "peft.get_peft_model(base_model, peft_config) (hf_fp8 then builds its FP8 LoRA layers, "
        f"or refuses a method that cannot work on FP8 layers, with the fix); or {merge}keep "
        f"these layers in high precision: skip={leaves!r}"
    )


def _refuse_shared_weights(
    model: nn.Module, targets: list[tuple[str, nn.Module, nn.Module]], *, defaults_off: bool
) -> None:
    """``ValueError`` before anything converts when a layer to convert shares its weight with
    another module (tied embeddings): the FP8 layer would hold its own copy, the tie would be
    broken and the saved checkpoint would not reload."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((f"{name}.{pname}" if name else pname, module))
    for name, module, _ in targets:
        others = sorted({k for k, m in holders.get(id(module.weight), []) if m is not module})
        if others:
            hint = (
                " (a transformers model keeps its tied layers by default; default_skips=False "
                "turned that off)"
                if defaults_off
                else ""
            )
            raise ValueError(
                f"hf_fp8.quantize_model: {name}.weight is shared with {', '.join(others)} (tied "
                f"weights). Converting {name} would untie them: the FP8 layer would hold its "
                "own copy, and the saved checkpoint would not reload. Keep it in high "
                f"precision: skip=[{name!r}]{hint}"
            )


def _transformers_model(model: nn.Module) -> PreTrainedModel | None:
    """``model`` itself, or the transformers model inside a ``PeftModel`` (``get_base_model``)
    or a ``PeftMixedModel`` (``get_peft_model(..., mixed=True)``: ``base_model.model``, it has
    no ``get_base_model``): its default skips apply, and it is the model ``merge_and_unload``
    returns and saves."""
    if isinstance(model, PreTrainedModel):
        return model
    if not type(model).__module__.startswith("peft."):
        return None
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        inner = get_base()
    else:  # PeftMixedModel -> MixedModel (a peft tuner) -> the transformers model
        inner = getattr(model.__dict__.get("_modules", {}).get("base_model"), "model", None)
    return inner if isinstance(inner, PreTrainedModel) else None


def quantize_model(
    model: nn.Module,
    config: Fp8Config,
    *,
    skip: Sequence[str] | None = None,
    module_filter_fn: ModuleFilter | None = None,
    default_skips: bool = True,
) -> nn.Module:
    """Quantize the linear layers of a high-precision ``model`` in place; return it.

    Which layers convert is ``hf_fp8.modules.is_convertible``: ``nn.Linear`` (and plain
    subclasses) and GPT-2 ``Conv1D``, never MoE routers; MoE experts modules become
    ``Fp8Experts`` (``hf_fp8.quantizer.experts.experts_to_convert``: also Llama-4's bmm
    experts, as ``Fp8BmmExperts``). Layers named in
    ``config.modules_to_not_convert`` or ``skip`` stay in high precision; a name that matches
    no module is warned about (a typo would otherwise quantize the layer it meant to keep).
    ``module_filter_fn(module, fqn)`` returning ``False`` keeps a layer too (as torchao's).

    On a transformers ``PreTrainedModel``, ``default_skips=True`` also keeps what
    ``from_pretrained(..., quantization_config=config)`` keeps (the same function,
    ``default_skipped_modules``): tied weights, the output embeddings (``lm_head``), the last
    module, ``_keep_in_fp32_modules`` (T5's ``wo``) and every task head (the linears outside
    ``model.base_model``: ``score``, ``classifier``, ``qa_outputs`` ...). ``default_skips=False``
    converts an untied ``lm_head`` and the task heads too. A layer whose weight is shared with another module (tied) is
    refused (``ValueError``) on any model: converting it would break the tie.

    A model that already holds ``Fp8Linear`` layers (a LoRA ``merge_and_unload`` leaves the
    merged layers in high precision and the others in FP8) gets its high-precision layers
    converted only when the FP8 ones use the same scheme (format, granularities, block size,
    activation scheme); one saved config must describe every layer. Another scheme is refused
    (``AlreadyQuantizedError``): load the high-precision checkpoint, or dequantize first
    (``model.dequantize()`` on a transformers model). With nothing left to convert, it warns.

    ``Fp8Config(dequantize=True)`` is refused (``ValueError``): it is a load option. So is a
    model whose layers to convert hold peft adapters (``get_peft_model`` ran first): their FP8
    bases would sit under peft's own layers, past hf_fp8's checks (``ValueError`` naming them,
    before anything converts). Quantize first, then ``get_peft_model`` (hf_fp8's
    ``Fp8LoraLinear``); or ``merge_and_unload()`` first, then quantize; or keep them with
    ``skip``. peft's ``modules_to_save`` copies stay in high precision (their originals convert).

    A transformers ``PreTrainedModel`` (also the one inside a ``PeftModel`` or
    ``PeftMixedModel``: its default skips apply) is then marked quantized like a ``from_pretrained`` load, so ``save_pretrained`` writes an hf_fp8 checkpoint that reloads pre-quantized.
    """
    if config.dequantize:
        raise ValueError(
            "hf_fp8.quantize_model: Fp8Config(dequantize=True) is for loading an FP8 checkpoint "
            "back in high precision (from_pretrained); quantize_model would return an FP8 model "
            "and save dequantize: true into config.json, so every reload would silently come "
            "back in high precision. Quantize with dequantize=False (the default)"
        )
    _check_existing_fp8(model, config)
    patterns = [*(config.modules_to_not_convert or []), *(module_names(skip, "skip") or [])]
    warn_unmatched(model, patterns, "modules_to_not_convert / skip")
    hf_model = _transformers_model(model)
    defaults = default_skipped_modules(hf_model) if default_skips and hf_model is not None else []
    asked = [p for p in dict.fromkeys(patterns) if p not in defaults]  # for a refusal's advice
    patterns += defaults
    targets = convertible_modules(model, skip=patterns, module_filter_fn=module_filter_fn)
    experts = experts_to_convert(model, skip=patterns, module_filter_fn=module_filter_fn)
    _refuse_peft_layers(model, [*(t[0] for t in targets), *(e[0] for e in experts)])
    _refuse_shared_weights(model, targets, defaults_off=not default_skips and hf_model is not None)
    if (
        not targets
        and not experts
        and any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())
    ):
        warnings.warn(
            "hf_fp8.quantize_model: every convertible layer is already FP8; nothing to do",
            UserWarning,
            stacklevel=2,
        )
    converted = [*(t[:2] for t in targets), *(e[:2] for e in experts)]
    check_activation_scales(model, config.activation_scales, converted=converted)
    _refuse_changed_calls(converted)
    # Every layer is quantized before the first swap, and the swaps are undone if anything
    # after them raises (Ctrl-C too): an error (a non-finite weight) leaves the model as it was.
    swaps = _build_linears(config, targets)
    swaps += _build_experts(config, experts)  # shared experts stay shared, one scale (R27 F3)
    undo = _saved_marks(model, hf_model)
    with swapped_modules(swaps):
        try:
            _mark(model, hf_model, config, asked)
        except BaseException:
            undo()
            raise
    return model


def _mark(
    model: nn.Module, hf_model: PreTrainedModel | None, config: Fp8Config, asked: list[str]
) -> None:
    """Mark the converted ``model`` (and its transformers model) quantized."""
    # before the hooks (its quantizer says pre_quantized); every FP8 layer, earlier calls' too
    skips, defaults_on = _kept_now(model, asked)
    mark_origin(model, QUANTIZE_MODEL, skips, default_skips=defaults_on, update=True)
    if hf_model is not None:  # a PeftModel: its transformers model is marked
        kept = unconverted_linears(hf_model)
        # the layers keep config's kernel; a checkpoint records none (R39 F5)
        saved = config.replace(modules_to_not_convert=kept, kernel="auto")
        quantizer = Fp8HfQuantizer(saved, pre_quantized=True)
        quantizer.modules_to_not_convert = kept
        hf_model.config.quantization_config = saved
        hf_model.hf_quantizer = quantizer
        hf_model.is_quantized = True
        hf_model.quantization_method = saved.quant_method
        for hook in POST_LOAD_HOOKS:
            hook(hf_model, quantizer)


_MISSING = object()
_MODEL_MARKS = ("hf_quantizer", "is_quantized", "quantization_method")


def _saved_marks(model: nn.Module, hf_model: PreTrainedModel | None) -> Callable[[], None]:
    """A function putting back what :func:`_mark` changes: the origin marks of the FP8 layers
    ``model`` holds now, the transformers model's quantization attributes and config entry."""
    layers = [
        (m, {k: m.__dict__[k] for k in (ORIGIN_KEY, SKIPS_KEY, DEFAULTS_KEY) if k in m.__dict__})
        for m in model.modules()
        if isinstance(m, (Fp8Linear, Fp8Experts))
    ]
    owners = [] if hf_model is None else [(hf_model, _MODEL_MARKS)]
    if hf_model is not None:
        owners.append((hf_model.config, ("quantization_config",)))
    attrs = [
        (obj, name, obj.__dict__.get(name, _MISSING)) for obj, names in owners for name in names
    ]

    def undo() -> None:
        for module, marks in layers:
            for key in (ORIGIN_KEY, SKIPS_KEY, DEFAULTS_KEY):
                module.__dict__.pop(key, None)
            module.__dict__.update(marks)
        for obj, name, value in attrs:
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value

    return undo
