"""Patch: ``PreTrainedModel.half()`` / ``.float()`` on hf_fp8 models behave like ``.to(dtype)``.

transformers refuses both on every quantized model ("already casted to the correct dtype"),
while ``.to(torch.float16)`` works and changes an hf_fp8 model's compute dtype (its FP8
weights and scales keep their storage dtype, see ``Fp8Linear._apply``). The wrappers route
hf_fp8 models to ``.to(dtype)`` and leave every other model to transformers' own method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_ORIGINAL: dict[str, Callable] = {}
_DTYPES = {"half": "float16", "float": "float32"}


def _is_hf_fp8(model: Any) -> bool:
    return getattr(model, "quantization_method", None) == "hf_fp8"


def _wrapper(name: str) -> Callable:
    def cast(self, *args):
        if _is_hf_fp8(self):
            import torch

            return self.to(getattr(torch, _DTYPES[name]))
        return _ORIGINAL[name](self, *args)

    return cast


def apply() -> None:
    """Wrap ``half`` and ``float`` once, on the class."""
    from transformers import PreTrainedModel

    for name in _DTYPES:
        if name in _ORIGINAL:
            continue
        original = getattr(PreTrainedModel, name)
        _ORIGINAL[name] = original
        setattr(PreTrainedModel, name, functools.wraps(original)(_wrapper(name)))


def applied() -> bool:
    return len(_ORIGINAL) == len(_DTYPES)


TRIGGERS = {"transformers.modeling_utils": apply}
