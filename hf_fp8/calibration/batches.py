"""What ``calibrate`` accepts as data, and a clear error for anything else.

Accepted: one batch (a dict / ``BatchEncoding`` of tensors, or a tensor of token ids), a list
or tuple of batches, or any other iterable of batches (a ``DataLoader``, a generator). A
batch is a mapping (``model(**batch)``), a tuple / list of tensors (``model(*batch)``) or a
tensor (``model(batch)``).

A top-level tuple of tensors is refused: ``calibrate(model, (input_ids, attention_mask))``
reads naturally as one batch of positional inputs, but a tuple is also a collection of
batches, and it used to run the mask as a second batch of token ids. So is a list in which a
tensor looks like the attention mask of the tensor before it (``[input_ids,
attention_mask]``: same shape, integer or bool, only 0 and 1): a list of tensors is a list
of batches of token ids. The errors name the unambiguous spellings of both meanings: one
batch as a dict or ``[(input_ids, attention_mask)]``, several as a list of such batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

ACCEPTED = (
    "one batch (a dict / BatchEncoding of tensors, or a tensor of token ids), a list of "
    "batches or a DataLoader"
)
_TOKENIZE = (
    "tokenize them first, e.g. batch = tokenizer(texts, return_tensors='pt', padding=True), "
    "and pass that batch (or a list of such batches)"
)


_UNAMBIGUOUS = (
    "Pass one batch as a dict {'input_ids': input_ids, 'attention_mask': attention_mask} "
    "(model(**batch), what a tokenizer returns) or as [(input_ids, attention_mask)] (a list "
    "holding one tuple: model(*batch)); several batches: a list of such batches, "
    "[batch_1, batch_2] (a bare tensor in that list is a whole batch of token ids)"
)


def _is_mask_of(mask: Any, ids: Any) -> bool:
    """``mask`` looks like the attention mask of ``ids``: same shape, integer or bool, only
    0 and 1 (token ids that are all 0 / 1 do not occur in real text)."""
    if not (isinstance(mask, torch.Tensor) and isinstance(ids, torch.Tensor)):
        return False
    if mask.shape != ids.shape or mask.numel() == 0:
        return False
    if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()):
        return False
    return bool(((mask == 0) | (mask == 1)).all())


def _refuse_a_mask_item(data: list[Any]) -> None:
    """Raise when an item of ``data`` looks like the attention mask of the one before it:
    ``calibrate(model, [input_ids, attention_mask])`` would run the mask as token ids."""
    for index in range(1, len(data)):
        if _is_mask_of(data[index], data[index - 1]):
            raise TypeError(
                f"calibrate got a list of tensors, and item {index} of the list looks like the "
                f"attention mask of item {index - 1} (same shape {tuple(data[index].shape)}, "
                f"only 0/1 values): each item of a list is a whole batch, so it would run as "
                f"token ids. {_UNAMBIGUOUS}"
            )


def _is_text(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)
    )


def as_batches(data: Any) -> Iterable[Any]:
    """``data`` as an iterable of batches; raises ``TypeError`` naming what it got."""
    if isinstance(data, str):
        raise TypeError(f"calibrate got a string, not a batch: {_TOKENIZE}")
    if isinstance(data, (Mapping, torch.Tensor)):
        return [data]  # one batch
    if isinstance(data, (list, tuple)) and _is_text(data):
        raise TypeError(f"calibrate got a list of strings: {_TOKENIZE}")
    if isinstance(data, tuple) and data and all(isinstance(v, torch.Tensor) for v in data):
        raise TypeError(
            f"calibrate got a tuple of {len(data)} tensors: one batch of positional inputs, or "
            f"{len(data)} batches? {_UNAMBIGUOUS}"
        )
    if isinstance(data, list):
        _refuse_a_mask_item(data)
    if not isinstance(data, Iterable):
        raise TypeError(f"calibrate expects {ACCEPTED}; got {type(data).__name__}")
    return data


def check_batch(index: int, batch: Any) -> None:
    """Raise ``TypeError`` naming batch ``index`` when the model cannot be called with it."""
    if _is_text(batch):
        raise TypeError(f"batch {index} holds strings, not tensors: {_TOKENIZE}")
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            if isinstance(value, (list, tuple, str)):
                raise TypeError(
                    f"batch {index}: {key!r} is a {type(value).__name__}, not a tensor: "
                    "tokenize with return_tensors='pt'"
                )
        return
    if isinstance(batch, (list, tuple)):
        for value in batch:
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"batch {index} is a {type(batch).__name__} holding a "
                    f"{type(value).__name__}: positional inputs must be tensors"
                )
        return
    if not isinstance(batch, torch.Tensor):
        raise TypeError(
            f"batch {index} is {type(batch).__name__}: each batch must be a dict of tensors, "
            "a tuple of tensors or a tensor"
        )
