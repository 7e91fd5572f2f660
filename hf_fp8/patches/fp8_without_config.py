"""Patch: ``PreTrainedModel._load_pretrained_model`` refuses FP8 weights loaded as plain ones.

With no quantizer (the checkpoint's ``config.json`` lost its ``quantization_config``, or
``config=`` passed the base model's), transformers reads fp8 codes into ``nn.Linear`` and
drops their scales: a silently wrong model. The wrapper runs
:func:`hf_fp8.quantizer.lost_config.check_fp8_has_config` first (safetensors headers of a
local folder only) when the load has no quantizer; every other load goes straight to
transformers' method. An unexpected failure of the check itself switches the check off with
one ``PatchWarning`` and loads as before (DESIGN §8: a patch fails alone).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

_NAME = "_load_pretrained_model"
_ORIGINAL: dict[str, Callable] = {}
_FAILED: list[str] = []  # the check failed once: off for this process


def _check(bound: inspect.BoundArguments) -> None:
    from hf_fp8.numerics.checks import CheckpointTensorError
    from hf_fp8.quantizer.lost_config import check_fp8_has_config

    args = bound.arguments
    load_config, model = args.get("load_config"), args.get("model")
    if args.get("state_dict") is not None or getattr(load_config, "hf_quantizer", 1) is not None:
        return  # quantized loads are their quantizer's; a state dict has no files
    try:
        check_fp8_has_config(
            str(getattr(load_config, "pretrained_model_name_or_path", "") or ""),
            args.get("checkpoint_files"),
            getattr(model, "config", None),
        )
    except CheckpointTensorError:
        raise
    except Exception as exc:  # the check's own failure: off, the load goes on
        from hf_fp8.patches import disable

        _FAILED.append(f"{type(exc).__name__}: {exc}")
        disable("fp8_without_config", _FAILED[0])


def _wrapper(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any):
        if not _FAILED:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                bound = None  # transformers changed the signature: its own error follows
            if bound is not None:
                _check(bound)
        return original(*args, **kwargs)

    return load


def apply() -> None:
    """Wrap the static method once, on the class."""
    from transformers import PreTrainedModel

    if _NAME in _ORIGINAL:
        return
    original = inspect.getattr_static(PreTrainedModel, _NAME)
    if not isinstance(original, staticmethod):
        raise TypeError(f"PreTrainedModel.{_NAME} is no longer a static method")
    func = original.__func__
    missing = {"model", "state_dict", "checkpoint_files", "load_config"} - set(
        inspect.signature(func).parameters
    )
    if missing:
        raise TypeError(f"PreTrainedModel.{_NAME} lacks the arguments {sorted(missing)}")
    from transformers import modeling_utils

    fields = getattr(
        getattr(modeling_utils, "LoadStateDictConfig", None), "__dataclass_fields__", {}
    )
    if not {"hf_quantizer", "pretrained_model_name_or_path"} <= set(fields):
        raise TypeError("LoadStateDictConfig no longer names hf_quantizer and the checkpoint path")
    _ORIGINAL[_NAME] = func
    setattr(PreTrainedModel, _NAME, staticmethod(_wrapper(func)))


def applied() -> bool:
    return _NAME in _ORIGINAL


TRIGGERS = {"transformers.modeling_utils": apply}
