"""Which positions of a calibration batch are real tokens (R27 F1).

A padded batch (a tokenizer's ``padding=True``, ``hf-fp8 calibrate``'s EOS padding) runs its
pad positions through every layer like real tokens; their activations are not those of any
input the model will quantize at inference, and they can set the scale (a pad embedding that
spikes after the norm) or give an expert that only padding reaches a scale of its own.

``TokenMask.set(batch)`` reads the batch's ``attention_mask`` (and ``decoder_attention_mask``,
encoder-decoder models), each ``[batch, seq]``; the observers then keep:

* a linear's input ``[batch, seq, ..., features]`` whose leading dims equal a mask's shape:
  the rows that mask keeps (two masks of the same shape: the rows either keeps);
* an input flattened to ``[batch * seq, features]``: the same rows, flattened;
* expert rows: those whose token (the routing's ``token_index``, over ``batch * seq``
  tokens) is kept.

An input whose leading dims match no mask (inputs not laid out per token, e.g. after a
model inserts or drops positions, or rows an older MoE gathered per expert) is observed
whole: rows that cannot be told apart are never dropped. A batch that is not a mapping
(positional tensors), or whose mask is all ones or not ``[batch, seq]``, masks nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

MASK_KEYS = ("attention_mask", "decoder_attention_mask")


class TokenMask:
    """The validity masks of the batch being run (``[batch, seq]`` bool each)."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []

    def set(self, batch: Any) -> None:
        self.masks = []
        if not isinstance(batch, Mapping):
            return
        for key in MASK_KEYS:
            mask = batch.get(key)
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.numel() == 0:
                continue
            if mask.is_complex():
                continue
            keep = mask != 0
            if not bool(keep.all()):
                self.masks.append(keep)

    def clear(self) -> None:
        self.masks = []

    def _keep_for(self, lead: tuple[int, ...]) -> torch.Tensor | None:
        """The keep mask for leading dims ``lead`` (``[b, s]`` or ``[b * s]``), or None."""
        keep = None
        for mask in self.masks:
            if lead == tuple(mask.shape):
                this = mask
            elif lead == (mask.numel(),):
                this = mask.reshape(-1)
            else:
                continue
            keep = this if keep is None else keep | this
        return keep

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` (a linear's input, features last) at real tokens."""
        if not self.masks or x.dim() < 2:
            return x
        for lead in (tuple(x.shape[:2]), (x.shape[0],)):
            if len(lead) == 2 and x.dim() < 3:
                continue  # a 2-D input is [tokens, features]: only the flat form applies
            keep = self._keep_for(lead)
            if keep is not None:
                return x[keep.to(x.device)]
        return x

    def tokens(self, num_tokens: int) -> torch.Tensor | None:
        """``[num_tokens]`` keep mask when the tokens are the batch's, flattened; else None."""
        if not self.masks:
            return None
        return self._keep_for((num_tokens,))
