"""Layers a pre-quantized checkpoint does not store at all: new ones, kept in high precision.

Loading an FP8 CausalLM folder with ``AutoModelForSequenceClassification`` builds a ``score``
head the checkpoint never had. transformers initialises such a layer as new (and says so in its
load report); as an ``Fp8Linear`` it would have no fp8 weight and no scale to load, so it is kept
in high precision, as an on-the-fly load keeps it. A layer whose fp8 weight is stored without its
scale is not new: it stays FP8 and is refused after loading, named.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from hf_fp8.modules import convertible_modules


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
    """The layers to convert (``skip`` aside) of which the checkpoint tensor ``names`` store
    neither ``weight`` nor ``weight_scale``, under the names the loader gives them. ``[]``
    when ``names`` is ``None`` (not readable) or no layer is found at all (keys the loader
    renames in a way not followed here: the checks after loading decide, as before)."""
    if names is None:
        return []
    targets = [name for name, _, _ in convertible_modules(model, skip=skip)]
    stored = loaded_names(model, (k for k in names if k.endswith((".weight", ".weight_scale"))))
    missing = [
        name
        for name in targets
        if f"{name}.weight" not in stored and f"{name}.weight_scale" not in stored
    ]
    return missing if len(missing) < len(targets) else []
