"""Layers a pre-quantized checkpoint does not store at all: new ones, kept in high precision.

Loading an FP8 CausalLM folder with ``AutoModelForSequenceClassification`` builds a ``score``
head the checkpoint never had. transformers initialises such a layer as new (and says so in its
load report); as an ``Fp8Linear`` it would have no fp8 weight and no scale to load, so it is kept
in high precision, as an on-the-fly load keeps it (task heads are default skips). A task head
(a layer outside ``model.base_model``: ``hf_fp8.modules.selection.task_heads``) can be new; a
body layer only when the checkpoint was saved from another class (``config.architectures``)
and stores nothing at all under the module holding it (a masked-LM checkpoint has no
``bert.pooler``; an encoder loaded as a decoder has no ``crossattention``), as transformers
initialises it. A body layer the checkpoint of the same class lacks, or whose siblings it stores
(a damaged or truncated file), stays FP8 and is refused after loading, named, as is a layer
whose fp8 weight is stored without its scale.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from hf_fp8.modules import convertible_modules
from hf_fp8.modules.selection import task_heads

# FP8 tensors next to a layer's ``weight`` (an ``nn.Linear`` before the swap has none): the
# meta state dict that decides whether the base-model prefix is added or stripped names them
# too, as the loader's (after the swap) does
_SCALE_LEAVES = ("weight_scale", "input_scale")
_EXPERTS_SCALE_SUFFIXES = ("_weight_scale", "_input_scale")


def _meta_names(model: nn.Module) -> dict[str, bool]:
    meta = dict.fromkeys(model.state_dict(), True)  # only membership is asked
    for key in list(meta):
        module, _, leaf = key.rpartition(".")
        if leaf == "weight":
            meta.update(dict.fromkeys((f"{module}.{s}" for s in _SCALE_LEAVES), True))
        else:  # a merged experts projection: gate_up_proj -> gate_up_proj_weight_scale
            meta.update(dict.fromkeys((f"{key}{s}" for s in _EXPERTS_SCALE_SUFFIXES), True))
    return meta


def _converter_targets(converters: list, source_pattern: str, renamed: str) -> tuple[str, ...]:
    """The names a one-to-many ``WeightConverter`` (``source_pattern`` matched) makes of one
    checkpoint tensor: transformers names it after the first target only (HRM's stored
    ``gqkv_proj`` -> ``gate_proj`` / ``q_proj`` / ``k_proj`` / ``v_proj``)."""
    for conv in converters:
        if source_pattern not in conv.source_patterns or len(conv.target_patterns) < 2:
            continue
        first = conv.target_patterns[0]
        where = renamed.rfind(first)
        if where < 0 or any("\\" in t for t in conv.target_patterns):
            return ()
        head, tail = renamed[:where], renamed[where + len(first) :]
        return tuple(f"{head}{t}{tail}" for t in conv.target_patterns[1:])
    return ()


def loaded_name_map(
    model: nn.Module, names: Iterable[str], key_mapping: dict[str, str] | None = None
) -> dict[str, tuple[str, bool, tuple[str, ...]]] | None:
    """``{checkpoint tensor name: (the name the loader gives it in model, whether a
    WeightConverter makes it: merged / split, another shape; the other names a one-to-many
    converter gives it)}`` (as :func:`loaded_names`; ``key_mapping``: the one passed to
    ``from_pretrained``); ``None`` when transformers' renaming is not available."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        mapping = get_model_conversion_mapping(model, key_mapping, None)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        meta = _meta_names(model)
        out = {}
        for k in names:
            renamed, source = rename_source_key(k, renamings, converters, prefix, meta)
            more = _converter_targets(converters, source, renamed) if source else ()
            out[k] = (renamed, source is not None, more)
        return out
    except Exception:  # another transformers
        return None


def loaded_names(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The checkpoint tensor ``names`` as the loader renames them into ``model``'s keys (the
    model's conversion mapping, then the base-model prefix added or stripped). Falls back to
    the names plus both prefix variants when transformers' renaming is not available."""
    names = list(names)
    prefix = getattr(model, "base_model_prefix", "") or ""
    mapped = loaded_name_map(model, names)
    if mapped is not None:
        return {n for renamed, _, more in mapped.values() for n in (renamed, *more)}
    # another transformers: the plain names and both prefix variants
    out = set(names)
    if prefix:
        out |= {f"{prefix}.{k}" for k in names}
        out |= {k.removeprefix(f"{prefix}.") for k in names}
    return out


def layers_not_stored(model: nn.Module, names: set[str] | None, skip: list[str]) -> list[str]:
    """The layers to convert (``skip`` aside) that are new (see the module docstring): the
    checkpoint tensor ``names`` store neither their ``weight`` nor ``weight_scale``, under the
    names the loader gives them. ``[]``
    when ``names`` is ``None`` (not readable) or no layer is found at all (keys the loader
    renames in a way not followed here: the checks after loading decide, as before)."""
    if names is None:
        return []
    targets = [name for name, _, _ in convertible_modules(model, skip=skip)]
    stored = loaded_names(model, names)
    holders = {key[:i] for key in stored for i, char in enumerate(key) if char == "."}
    heads = set(task_heads(model))
    architectures = getattr(getattr(model, "config", None), "architectures", None) or []
    other_class = bool(architectures) and type(model).__name__ not in architectures

    def new(name: str) -> bool:
        if f"{name}.weight" in stored or f"{name}.weight_scale" in stored:
            return False
        return name in heads or (other_class and name.rpartition(".")[0] not in holders)

    missing = [name for name in targets if new(name)]
    return missing if len(missing) < len(targets) else []


def heads_stored_fp8(model: nn.Module, names: set[str] | None) -> list[str]:
    """The task heads of ``model`` whose ``weight_scale`` the checkpoint tensor ``names`` store
    (under the loader's names): FP8 heads of a checkpoint whose config lists no
    ``modules_to_not_convert`` (a hand-written one), which the default skips must not keep."""
    if names is None:
        return []
    stored = loaded_names(model, (k for k in names if k.endswith(".weight_scale")))
    return [name for name in task_heads(model) if f"{name}.weight_scale" in stored]
