"""Patch: ``PreTrainedModel.resize_token_embeddings`` refuses to resize an FP8 output layer.

transformers resizes the output embeddings (``lm_head``) by building a new
``nn.Linear(dtype=old_head.weight.dtype)`` and copying the old rows into it. For an
``Fp8Linear`` head (``quantize_model(..., default_skips=False)``, or the reload of such a
checkpoint) that is an fp8 ``nn.Linear``, whose initialisation torch refuses
(``NotImplementedError: "check_uniform_bounds" not implemented for 'Float8_e4m3fn'``) after the
input embeddings were already resized; had it gone on, it would copy fp8 codes into a plain
layer without their scales (R31 F1). The wrapper refuses such a resize before anything changes,
naming the fix: resize before quantizing, or keep the head in high precision. (Resizing the
FP8 head in place is not done: new rows quantized with a per-tensor or block scale they did not
make could saturate, and an in-place answer would differ from the float model's.)

A resize that keeps the head's size, and every model whose output embeddings are not an FP8
layer (hf_fp8's default: the head stays in high precision), go to transformers' own method.
A tied head is never FP8 (``quantize_model`` and ``from_pretrained`` keep tied layers).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

_NAME = "resize_token_embeddings"


def _fp8_head(model: Any) -> Any:
    """The model's output embeddings when they are an FP8 layer (also under a peft adapter's
    ``base_layer``), else None."""
    from hf_fp8.modules import Fp8Linear

    try:
        head = model.get_output_embeddings()
    except Exception:  # a model without output embeddings: transformers' own answer
        return None
    for _ in range(8):  # peft wraps: lora.Linear(base_layer=Fp8Linear)
        if head is None or isinstance(head, Fp8Linear):
            return head
        head = getattr(head, "base_layer", None)
    return None


def _new_size(model: Any, new_num_tokens: Any, pad_to_multiple_of: Any) -> int | None:
    """The number of rows transformers would give the output embeddings (its own rule), or
    None when it resizes nothing or refuses the arguments itself."""
    if new_num_tokens is None and pad_to_multiple_of is None:
        return None
    size = new_num_tokens
    if size is None:
        size = model.get_input_embeddings().weight.shape[0]
    if pad_to_multiple_of is not None:
        if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of <= 0:
            return None  # transformers raises its error before changing anything
        size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
    return int(size)


def _module_name(model: Any, module: Any) -> str:
    return next((n for n, m in model.named_modules() if m is module), "") or "lm_head"


def check_resize(model: Any, new_num_tokens: Any, pad_to_multiple_of: Any) -> None:
    """Raise ``ValueError`` when ``resize_token_embeddings(new_num_tokens,
    pad_to_multiple_of)`` would resize an FP8 output layer of ``model``."""
    head = _fp8_head(model)
    if head is None:
        return
    size = _new_size(model, new_num_tokens, pad_to_multiple_of)
    if size is None or size == head.out_features:
        return
    name = _module_name(model, head)
    raise ValueError(
        f"hf_fp8: resize_token_embeddings to {size} tokens would resize {name}, an FP8 layer "
        f"({head.out_features} rows of fp8 codes with their weight scales), which "
        "transformers cannot resize: it rebuilds the layer as a plain nn.Linear in fp8 and "
        "would copy the codes without their scales. Nothing was changed. Resize the token "
        "embeddings before quantizing (on the high-precision model, then hf_fp8.quantize_model "
        "or from_pretrained with Fp8Config, which keep the output embeddings in high precision "
        f"by default), or keep {name} in high precision: Fp8Config(modules_to_not_convert="
        f"[{name!r}]) (quantize_model(..., default_skips=False) converts it)"
    )


def _wrapper(original: Callable) -> Callable:
    """transformers' ``original`` lives in the closure (and ``__wrapped__``), not in a module
    dict that ``importlib.reload`` would empty (R26 1); the wrapper is marked ``_hf_fp8``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def resize_token_embeddings(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # transformers' own error for the call
            return original(self, *args, **kwargs)
        arguments = bound.arguments
        check_resize(self, arguments.get("new_num_tokens"), arguments.get("pad_to_multiple_of"))
        return original(self, *args, **kwargs)

    resize_token_embeddings._hf_fp8 = True
    return resize_token_embeddings


def _is_wrapped(cls: type) -> bool:
    return bool(getattr(inspect.getattr_static(cls, _NAME, None), "_hf_fp8", False))


def apply() -> None:
    """Wrap ``resize_token_embeddings`` once, on the class ("once" is read from the class: a
    reloaded module does not wrap its own wrapper)."""
    from transformers import PreTrainedModel

    if _is_wrapped(PreTrainedModel):
        return
    original = getattr(PreTrainedModel, _NAME)
    setattr(PreTrainedModel, _NAME, _wrapper(original))


def applied() -> bool:
    cls = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    return cls is not None and _is_wrapped(cls)


TRIGGERS = {"transformers.modeling_utils": apply}
