"""Model cards on ``save_pretrained`` and ``push_to_hub`` of models loaded through hf_fp8.

After an hf_fp8 load, :func:`attach_card_hooks` marks the model (state in its
``__dict__``, so copies keep it) and wraps two ``PreTrainedModel`` methods once, which act
on marked models only: ``save_pretrained`` writes ``README.md`` next to the weights, and
``_upload_modified_files`` — where ``push_to_hub`` and ``save_pretrained(push_to_hub=True)``
both end — replaces the placeholder card transformers wrote with hf_fp8's. Nothing here
touches the network.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from hf_fp8.config import Fp8Config
from hf_fp8.hub.card import read_card_info, write_model_card
from hf_fp8.hub.card_info import hub_model_id, info_from_model
from hf_fp8.modules import Fp8Linear

_STATE = "_hf_fp8_card"


def _is_fp8(model: nn.Module) -> bool:
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    return isinstance(qc, Fp8Config) and any(isinstance(m, Fp8Linear) for m in model.modules())


def _local_name(path: str | os.PathLike) -> str:
    """A folder's own name: cards never carry the local directory layout."""
    return Path(path).name or str(path)


def _previous_card(name_or_path: str) -> str | None:
    """README.md of the folder or cached repo a model was loaded from (never downloads)."""
    if not name_or_path:
        return None
    path = Path(name_or_path) / "README.md"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "README.md")
    except Exception:  # not a repo id
        return None
    return Path(cached).read_text(encoding="utf-8") if isinstance(cached, str) else None


def set_card_info(
    model: nn.Module, *, base_model: str | None = None, fidelity: dict[str, Any] | None = None
) -> None:
    """Record facts for the model card: the base model (a Hub id) and fidelity figures the
    user measured (e.g. ``{"mean cosine vs fp32": 0.9987}``)."""
    state = model.__dict__.setdefault(_STATE, {})
    if base_model is not None:
        state["base_model"] = str(base_model)
    if fidelity is not None:
        state["fidelity"] = {str(k): v for k, v in fidelity.items()}


_ORIGINAL: dict[str, Callable] = {}  # transformers' own methods, once wrapped


def _save_pretrained(self: nn.Module, save_directory: str | os.PathLike, *args, **kwargs):
    result = _ORIGINAL["save_pretrained"](self, save_directory, *args, **kwargs)
    if (
        _STATE in self.__dict__
        and not kwargs.get("push_to_hub")
        and _is_fp8(self)
        and os.path.isdir(save_directory)
    ):
        write_model_card(
            save_directory, info_from_model(self), model_id=_local_name(save_directory)
        )
    return result


def _upload_modified_files(
    self: nn.Module, working_dir: str | os.PathLike, repo_id: str, *args, **kwargs
):
    if _STATE in self.__dict__ and _is_fp8(self):
        write_model_card(working_dir, info_from_model(self, repo_id=repo_id))
    return _ORIGINAL["_upload_modified_files"](self, working_dir, repo_id, *args, **kwargs)


def _wrap_transformers_methods() -> None:
    """Wrap ``PreTrainedModel.save_pretrained`` / ``_upload_modified_files`` once.

    The wrappers act only on models :func:`attach_card_hooks` marked (their ``__dict__``
    holds the card state) and call transformers' own method otherwise. Methods on the class,
    not on the instance: a bound method stored on the instance would make a reference cycle
    (a dropped model would keep its weights until the next full garbage collection).
    """
    from transformers import PreTrainedModel

    if _ORIGINAL:
        return
    for name, wrapper in (
        ("save_pretrained", _save_pretrained),
        ("_upload_modified_files", _upload_modified_files),
    ):
        original = getattr(PreTrainedModel, name)
        _ORIGINAL[name] = original
        setattr(PreTrainedModel, name, functools.wraps(original)(wrapper))


def attach_card_hooks(model: nn.Module, hf_quantizer: Any = None) -> None:
    """Make ``model``'s saves and pushes carry hf_fp8's model card (idempotent). The base
    model is the checkpoint quantized on the fly, or what the card of a reloaded FP8
    checkpoint names."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    _wrap_transformers_methods()
    state = model.__dict__.setdefault(_STATE, {})
    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    if hf_quantizer is not None and getattr(hf_quantizer, "pre_quantized", False):
        previous = read_card_info(_previous_card(name) or "")
        if previous is not None:
            state.setdefault("base_model", previous.base_model)
            state.setdefault("fidelity", previous.fidelity)
    elif name:
        state.setdefault("base_model", hub_model_id(name) or _local_name(name))
