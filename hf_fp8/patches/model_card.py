"""Patch: ``PreTrainedModel.save_pretrained`` and ``_upload_modified_files`` (card + atomic save).

Both methods are wrapped once, on the class (a bound method stored on each instance would make
a reference cycle that keeps a dropped model's weights alive). The wrappers act only on models
that ``hf_fp8.hub.hooks.attach_card_hooks`` marked after an hf_fp8 load (and
``save_pretrained(state_dict=...)`` on any model with hf_fp8's quantizer: the state dict passed
is checked, then saved, ``hf_fp8.hub.hooks.check_state_dict``), and call transformers' own
method for every other model. Each method is wrapped on its own: when
``_upload_modified_files`` (private; where ``push_to_hub`` ends) is renamed, saves still carry
the card and only pushes lose it, with one warning.

The post-load hook that marks models is added to hf_fp8's own ``POST_LOAD_HOOKS`` when
``hf_fp8.quantizer.hf_quantizer`` is imported; the class is wrapped at the first hf_fp8 load.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

TRIGGER = "hf_fp8.quantizer.hf_quantizer"
_FAILED: dict[str, str] = {}
# transformers' own methods live in the wrappers' closures (and ``__wrapped__``), never in a
# module dict that ``importlib.reload`` (IPython %autoreload) would empty (R26 1); wrappers
# and the post-load marker carry ``_hf_fp8``, so a reloaded module finds them on the class.


def _save_pretrained(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        from hf_fp8.hub import hooks

        return hooks.save_pretrained(original, self, save_directory, *args, **kwargs)

    return save_pretrained


def _upload_modified_files(original: Callable) -> Callable:
    @functools.wraps(original)
    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        from hf_fp8.hub.hooks import before_upload

        before_upload(self, working_dir, repo_id)
        return original(self, working_dir, repo_id, *args, **kwargs)

    return _upload_modified_files


_WRAPPERS = {"save_pretrained": _save_pretrained, "_upload_modified_files": _upload_modified_files}


def _is_wrapped(cls: type, name: str) -> bool:
    return bool(getattr(inspect.getattr_static(cls, name, None), "_hf_fp8", False))


def apply() -> None:
    """Wrap the two methods (idempotent, read from the class); one that is missing switches
    only its part off."""
    from transformers import PreTrainedModel

    for name, make in _WRAPPERS.items():
        if name in _FAILED or _is_wrapped(PreTrainedModel, name):
            continue
        original = getattr(PreTrainedModel, name, None)
        if not callable(original):
            _FAILED[name] = f"PreTrainedModel.{name} is gone"
            continue
        wrapper = make(original)
        wrapper._hf_fp8 = True
        setattr(PreTrainedModel, name, wrapper)
    if len(_FAILED) == len(_WRAPPERS):
        raise RuntimeError("; ".join(_FAILED.values()))
    if _FAILED:
        from hf_fp8.patches import disable

        disable("model_card", "; ".join(_FAILED.values()), partly=True)


def _has_marker(hooks: list) -> bool:
    return any(getattr(hook, "_hf_fp8", None) == "model_card" for hook in hooks)


def applied() -> bool:
    """True once the post-load marker is in place (the class is wrapped at the first load)."""
    module = sys.modules.get(TRIGGER)
    return module is not None and _has_marker(module.POST_LOAD_HOOKS)


def is_wrapped(name: str) -> bool:
    """True when ``PreTrainedModel.<name>`` goes through hf_fp8's wrapper."""
    cls = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return cls is not None and _is_wrapped(cls, name)


def _post_load(model: Any, hf_quantizer: Any = None) -> None:
    """Mark ``model`` for cards after an hf_fp8 load; never fails the load."""
    try:
        from hf_fp8.hub.hooks import attach_card_hooks

        attach_card_hooks(model, hf_quantizer)
    except Exception as exc:
        from hf_fp8.patches import disable

        disable("model_card", f"marking the loaded model failed: {exc!r}", partly=True)


_post_load._hf_fp8 = "model_card"


def add_post_load_hook() -> None:
    """Put the marker into hf_fp8's ``POST_LOAD_HOOKS`` (hf_fp8's own list, idempotent)."""
    module = sys.modules.get(TRIGGER)
    if module is None:
        import importlib

        module = importlib.import_module(TRIGGER)
    if not _has_marker(module.POST_LOAD_HOOKS):
        module.POST_LOAD_HOOKS.append(_post_load)


TRIGGERS = {TRIGGER: add_post_load_hook}
