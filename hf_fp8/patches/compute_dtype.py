"""Patch: ``PreTrainedModel.dtype`` of a model holding hf_fp8 layers is its compute dtype.

transformers' ``dtype`` is the dtype of the first floating parameter, and fp8 counts as
floating: a model whose first parameter is an FP8 weight (PatchTST, BLT, BridgeTower,
Granite Speech, ...) said ``float8_e4m3fn``, ``save_pretrained`` wrote that to config.json
(which the reload refused) and ``input.to(self.dtype)`` fed fp8 activations to the model.

The wrapper keeps transformers' answer unless it is an fp8 dtype; then it walks the modules
in ``parameters()`` order and answers what the high-precision model would have: the
``compute_dtype`` of an FP8 layer (``Fp8Linear`` / ``Fp8Experts``) met first, else the
first floating parameter's dtype. An fp8 parameter that no hf_fp8 layer holds (another
quantizer's) is left as transformers reports it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def compute_dtype(model: Any, first: torch.dtype) -> torch.dtype:
    """``first`` (transformers' answer) unless an hf_fp8 layer comes before any other
    floating parameter: then that layer's compute dtype."""
    from hf_fp8.modules import Fp8Experts, Fp8Linear

    for module in model.modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            return module.compute_dtype
        for param in module._parameters.values():
            if param is not None and param.is_floating_point():
                return param.dtype if param.dtype not in _FP8 else first
    return first


def _wrap(original: Callable) -> Callable:
    """The getter: transformers' ``original`` kept in the closure (and ``__wrapped__``), not
    in a module dict that ``importlib.reload`` would empty (R26 1); marked ``_hf_fp8``."""

    @functools.wraps(original)
    def dtype(self) -> torch.dtype:
        first = original(self)
        if first not in _FP8:
            return first
        return compute_dtype(self, first)

    dtype._hf_fp8 = True
    return dtype


def _property(cls: type) -> Any:
    return inspect.getattr_static(cls, "dtype", None)


def _is_wrapped(prop: Any) -> bool:
    return isinstance(prop, property) and bool(getattr(prop.fget, "_hf_fp8", False))


def apply() -> None:
    """Wrap the ``dtype`` property once, on ``PreTrainedModel`` (classes that define their
    own ``dtype``, such as BridgeTower's vision model, keep it). "Once" is read from the
    class: a reloaded module does not wrap its own wrapper."""
    from transformers import PreTrainedModel

    prop = _property(PreTrainedModel)
    if _is_wrapped(prop):
        return
    if not isinstance(prop, property) or prop.fget is None:
        raise TypeError(f"PreTrainedModel.dtype is {type(prop).__name__}, not a property")
    PreTrainedModel.dtype = property(_wrap(prop.fget), doc=prop.__doc__)


def applied() -> bool:
    cls = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return cls is not None and _is_wrapped(_property(cls))


TRIGGERS = {"transformers.modeling_utils": apply}
