"""Patch: ``PreTrainedModel._load_pretrained_model`` refuses FP8 weights loaded as plain ones.

With no quantizer (the checkpoint's ``config.json`` lost its ``quantization_config``,
``config=`` passed the base model's, ``quantization_config=None``, or an unknown
``quant_method``), or with a third-party quantizer that quantizes on the fly (R7 1:
``FineGrainedFP8Config(dequantize=True)``, ``TorchAoConfig`` … on such a folder), transformers
reads fp8 codes as plain weights and drops their scales: a silently wrong model.
transformers' own ``fp8`` quantizer does the same with a per-tensor vLLM export's
``weight_scale``. The wrapper runs the matching check of :mod:`hf_fp8.quantizer.lost_config`
first (the dtypes, no tensor data, of the files transformers is about to read — safetensors
headers, ``pytorch_model*.bin`` pickles (R7 2) — of a local folder, a Hub cache snapshot, a Hub
id resolved from the cache, or of the ``state_dict=`` passed); every other load goes straight
to transformers' method. A file that cannot be read leaves that one
load unchecked (transformers reports the file). An unexpected failure of the check itself (an
internal or API mismatch) switches the check off with one ``PatchWarning`` and loads as before
(DESIGN §8: a patch fails alone).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

_NAME = "_load_pretrained_model"
_FAILED: list[str] = []  # the check failed once: off for this process


def _quant_method(hf_quantizer: Any) -> str:
    method = getattr(getattr(hf_quantizer, "quantization_config", None), "quant_method", None)
    return str(getattr(method, "value", method))


def _is_finegrained_fp8(hf_quantizer: Any) -> bool:
    """transformers' own ``fp8`` quantizer (FineGrainedFP8) loading a pre-quantized checkpoint."""
    return _quant_method(hf_quantizer) == "fp8" and bool(
        getattr(hf_quantizer, "pre_quantized", False)
    )


def _quantizes_on_the_fly(hf_quantizer: Any) -> bool:
    """A third-party quantizer that reads the checkpoint as plain weights (R7 1). hf_fp8's own
    refuses fp8 checkpoint tensors itself, per tensor, with its own message."""
    from hf_fp8.config import QUANT_METHOD

    return getattr(hf_quantizer, "pre_quantized", True) is False and (
        _quant_method(hf_quantizer) != QUANT_METHOD
    )


def _check(bound: inspect.BoundArguments) -> None:
    from hf_fp8.numerics.checks import CheckpointTensorError
    from hf_fp8.quantizer import lost_config

    args = bound.arguments
    load_config, model = args.get("load_config"), args.get("model")
    state_dict = args.get("state_dict")
    hf_quantizer = getattr(load_config, "hf_quantizer", 1)
    name = str(getattr(load_config, "pretrained_model_name_or_path", "") or "")
    # transformers reads the state dict when there is one, else the files
    files = None if state_dict is not None else args.get("checkpoint_files")
    config = getattr(model, "config", None)
    try:
        if hf_quantizer is None:
            lost_config.check_fp8_has_config(name, files, config, state_dict=state_dict)
        elif _quantizes_on_the_fly(hf_quantizer):
            lost_config.check_fp8_has_config(
                name, files, config, quantizing=_quant_method(hf_quantizer), state_dict=state_dict
            )
        elif state_dict is None and _is_finegrained_fp8(hf_quantizer):
            lost_config.check_fp8_scales_for_finegrained(name, files, model)
    except CheckpointTensorError:
        raise
    except (OSError, RecursionError, MemoryError):
        return  # a file of this checkpoint cannot be read: transformers reports it next
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

    load._hf_fp8 = True  # transformers' method is in the closure (and __wrapped__)
    return load


def _is_wrapped(cls: type) -> bool:
    attr = inspect.getattr_static(cls, _NAME, None)
    return bool(getattr(getattr(attr, "__func__", None), "_hf_fp8", False))


def apply() -> None:
    """Wrap the static method once, on the class ("once" is read from the class: a module
    reloaded by ``importlib.reload`` / IPython %autoreload does not wrap it twice, R26 1)."""
    from transformers import PreTrainedModel

    if _is_wrapped(PreTrainedModel):
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
    setattr(PreTrainedModel, _NAME, staticmethod(_wrapper(func)))


def applied() -> bool:
    cls = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return cls is not None and _is_wrapped(cls)


TRIGGERS = {"transformers.modeling_utils": apply}
