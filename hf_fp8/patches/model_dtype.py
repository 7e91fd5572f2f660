"""Patch: ``PreTrainedModel.half()`` / ``.float()`` on hf_fp8 models behave like ``.to(dtype)``;
``.to(<an fp8 dtype>)`` on them is refused before anything is cast.

transformers refuses both on every quantized model ("already casted to the correct dtype"),
while ``.to(torch.float16)`` works and changes an hf_fp8 model's compute dtype (its FP8
weights and scales keep their storage dtype, see ``Fp8Linear._apply``). The wrappers route
hf_fp8 models to ``.to(dtype)`` and leave every other model to transformers' own method.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

_DTYPES = {"half": "float16", "float": "float32"}


def _is_hf_fp8(model: Any) -> bool:
    return getattr(model, "quantization_method", None) == "hf_fp8"


def _wrapper(name: str, original: Callable) -> Callable:
    """transformers' ``original`` is kept in the closure (and ``__wrapped__``), not in a module
    dict that ``importlib.reload`` would empty (R26 1); the wrapper is marked ``_hf_fp8``."""

    @functools.wraps(original)
    def cast(self, *args):
        if _is_hf_fp8(self):
            import torch

            return self.to(getattr(torch, _DTYPES[name]))
        return original(self, *args)

    cast._hf_fp8 = True
    return cast


def _to_wrapper(original: Callable) -> Callable:
    """``model.to(torch.float8_e4m3fn)`` on an hf_fp8 model is refused before any module is
    cast (R31 P21; ``Fp8Linear._apply`` refuses it too, but only once torch reaches that
    layer, after the embeddings were cast)."""

    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if _is_hf_fp8(self):
            import torch

            from hf_fp8.modules.fp8_linear import refuse_fp8_compute_dtype

            dtype = torch._C._nn._parse_to(*args, **kwargs)[1]
            if dtype is not None:
                refuse_fp8_compute_dtype(self, dtype, whole_model=True)
        return original(self, *args, **kwargs)

    to._hf_fp8 = True
    return to


def _is_wrapped(cls: type, name: str) -> bool:
    return bool(getattr(inspect.getattr_static(cls, name, None), "_hf_fp8", False))


def apply() -> None:
    """Wrap ``half`` and ``float`` once, on the class ("once" is read from the class: a
    reloaded module does not wrap its own wrappers)."""
    from transformers import PreTrainedModel

    for name in _DTYPES:
        if _is_wrapped(PreTrainedModel, name):
            continue
        original = getattr(PreTrainedModel, name)
        setattr(PreTrainedModel, name, _wrapper(name, original))
    if not _is_wrapped(PreTrainedModel, "to"):
        PreTrainedModel.to = _to_wrapper(PreTrainedModel.to)


def applied() -> bool:
    cls = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return cls is not None and all(_is_wrapped(cls, name) for name in (*_DTYPES, "to"))


TRIGGERS = {"transformers.modeling_utils": apply}
