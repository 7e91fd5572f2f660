"""What ``calibrate`` accepts as data, and a clear error for anything else.

Accepted: one batch (a dict / ``BatchEncoding`` of tensors, or a tensor of token ids), a list
or tuple of batches, or any other iterable of batches (a ``DataLoader``, a generator). A
batch is a mapping (``model(**batch)``), a tuple / list of tensors (``model(*batch)``) or a
tensor (``model(batch)``).

A top-level tuple of tensors is refused: ``calibrate(model, (input_ids, attention_mask))``
reads naturally as one batch of positional inputs, but a tuple is also a collection of
batches, and it used to run the mask as a second batch of token ids. The error names the
unambiguous spellings of both meanings.
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
            f"{len(data)} batches? Pass one batch as [(input_ids, attention_mask)] (a list "
            "holding the tuple: model(*batch)) or as a dict {'input_ids': input_ids, "
            "'attention_mask': attention_mask} (model(**batch), what a tokenizer returns); "
            "several batches of token ids as a list [ids_1, ids_2]"
        )
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
