"""Patch: ``PreTrainedModel.save_pretrained`` and ``_upload_modified_files`` (card + atomic save).

Both methods are wrapped once, on the class (a bound method stored on each instance would make
a reference cycle that keeps a dropped model's weights alive). The wrappers act only on models
that ``hf_fp8.hub.hooks.attach_card_hooks`` marked after an hf_fp8 load, and call
transformers' own method for every other model. Each method is wrapped on its own: when
``_upload_modified_files`` (private; where ``push_to_hub`` ends) is renamed, saves still carry
the card and only pushes lose it, with one warning.

The post-load hook that marks models is added to hf_fp8's own ``POST_LOAD_HOOKS`` when
``hf_fp8.quantizer.hf_quantizer`` is imported; the class is wrapped at the first hf_fp8 load.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

TRIGGER = "hf_fp8.quantizer.hf_quantizer"
_ORIGINAL: dict[str, Callable] = {}  # transformers' own methods, once wrapped
_FAILED: dict[str, str] = {}


def _save_pretrained(self, save_directory, *args, **kwargs):
    from hf_fp8.hub.hooks import save_pretrained

    return save_pretrained(_ORIGINAL["save_pretrained"], self, save_directory, *args, **kwargs)


def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
    from hf_fp8.hub.hooks import before_upload

    before_upload(self, working_dir, repo_id)
    return _ORIGINAL["_upload_modified_files"](self, working_dir, repo_id, *args, **kwargs)


_WRAPPERS = {"save_pretrained": _save_pretrained, "_upload_modified_files": _upload_modified_files}


def apply() -> None:
    """Wrap the two methods (idempotent); one that is missing switches only its part off."""
    from transformers import PreTrainedModel

    for name, wrapper in _WRAPPERS.items():
        if name in _ORIGINAL or name in _FAILED:
            continue
        original = getattr(PreTrainedModel, name, None)
        if not callable(original):
            _FAILED[name] = f"PreTrainedModel.{name} is gone"
            continue
        _ORIGINAL[name] = original
        setattr(PreTrainedModel, name, functools.wraps(original)(wrapper))
    if len(_FAILED) == len(_WRAPPERS):
        raise RuntimeError("; ".join(_FAILED.values()))
    if _FAILED:
        from hf_fp8.patches import disable

        disable("model_card", "; ".join(_FAILED.values()), partly=True)


def applied() -> bool:
    """True once the post-load marker is in place (the class is wrapped at the first load)."""
    module = sys.modules.get(TRIGGER)
    return module is not None and _post_load in module.POST_LOAD_HOOKS


def is_wrapped(name: str) -> bool:
    """True when ``PreTrainedModel.<name>`` goes through hf_fp8's wrapper."""
    return name in _ORIGINAL


def _post_load(model: Any, hf_quantizer: Any = None) -> None:
    """Mark ``model`` for cards after an hf_fp8 load; never fails the load."""
    try:
        from hf_fp8.hub.hooks import attach_card_hooks

        attach_card_hooks(model, hf_quantizer)
    except Exception as exc:
        from hf_fp8.patches import disable

        disable("model_card", f"marking the loaded model failed: {exc!r}", partly=True)


def add_post_load_hook() -> None:
    """Put the marker into hf_fp8's ``POST_LOAD_HOOKS`` (hf_fp8's own list, idempotent)."""
    module = sys.modules.get(TRIGGER)
    if module is None:
        import importlib

        module = importlib.import_module(TRIGGER)
    if _post_load not in module.POST_LOAD_HOOKS:
        module.POST_LOAD_HOOKS.append(_post_load)


TRIGGERS = {TRIGGER: add_post_load_hook}
