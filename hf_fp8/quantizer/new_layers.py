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


def loaded_name_map(model: nn.Module, names: Iterable[str]) -> dict[str, tuple[str, bool]] | None:
    """``{checkpoint tensor name: (the name the loader gives it in model, whether a
    WeightConverter makes it: merged / split, another shape)}`` (as :func:`loaded_names`);
    ``None`` when transformers' renaming is not available."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        mapping = get_model_conversion_mapping(model, None, None)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        meta = dict.fromkeys(model.state_dict(), True)  # only membership is asked
        out = {}
        for k in names:
            renamed, converter = rename_source_key(k, renamings, converters, prefix, meta)
            out[k] = (renamed, converter is not None)
        return out
    except Exception:  # another transformers
        return None


def loaded_names(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The checkpoint tensor ``names`` as the loader renames them into ``model``'s keys (the
    model's conversion mapping, then the base-model prefix added or stripped). Falls back to
    the names plus both prefix variants when transformers' renaming is not available."""
    names = list(names)
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        mapping = get_model_conversion_mapping(model, None, None)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        meta = dict.fromkeys(model.state_dict(), True)  # only membership is asked
        return {rename_source_key(k, renamings, converters, prefix, meta)[0] for k in names}
    except Exception:  # another transformers: the plain names and both prefix variants
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
