"""Which positions of a calibration batch are real tokens (R27 F1).

A padded batch (a tokenizer's ``padding=True``, ``hf-fp8 calibrate``'s EOS padding) runs its
pad positions through every layer like real tokens; their activations are not those of any
input the model will quantize at inference, and they can set the scale (a pad embedding that
spikes after the norm) or give an expert that only padding reaches a scale of its own.

``TokenMask.set(batch)`` reads the batch's ``attention_mask`` (and ``decoder_attention_mask``,
encoder-decoder models), each ``[batch, seq]``; the observers then keep:

* a linear's input ``[batch, seq, ..., features]`` whose leading dims equal a mask's shape:
  the rows that mask keeps (two masks of the same shape: the rows either keeps; an
  encoder-decoder batch without ``decoder_attention_mask``: every decoder position);
* an input flattened to ``[batch * seq, features]``: the same rows, flattened (when only
  one mask shape has that many positions);
* expert rows: those whose token (the routing's ``token_index``, over ``batch * seq``
  tokens) is kept.

An input whose leading dims match no mask (inputs not laid out per token, e.g. after a
model inserts or drops positions, or rows an older MoE gathered per expert) is observed
whole: rows that cannot be told apart are never dropped. A tuple batch (``model(*batch)``)
is read by the forward's parameter names (``[(input_ids, attention_mask)]`` for a model
whose second parameter is ``attention_mask``). A bare tensor batch, or a mask that is all
ones or not ``[batch, seq]``, masks nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

MASK_KEYS = ("attention_mask", "decoder_attention_mask")
# where an encoder-decoder batch without a decoder_attention_mask shows its decoder length
DECODER_KEYS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def _mask(value: Any) -> torch.Tensor | None:
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.numel() == 0:
        return None
    return None if value.is_complex() else value != 0


class TokenMask:
    """The positions to observe in the batch being run, by ``[batch, seq]`` shape.

    ``encoder_decoder`` (``model.config.is_encoder_decoder``): the decoder's positions are
    all real unless the batch has a ``decoder_attention_mask``; when the decoder's length
    equals the encoder's, a ``[batch, seq]`` input could be either, so it keeps the
    positions either mask keeps (all of them, without a decoder mask).
    """

    def __init__(self, encoder_decoder: bool = False, positional: tuple[str, ...] = ()) -> None:
        self.encoder_decoder = encoder_decoder
        self.positional = positional  # the forward's parameter names, for tuple batches
        self.keeps: dict[tuple[int, ...], torch.Tensor | None] = {}  # None: all kept

    def set(self, batch: Any) -> None:
        self.keeps = {}
        if isinstance(batch, (list, tuple)):  # model(*batch): named by the forward's signature
            batch = dict(zip(self.positional, batch, strict=False))
        if not isinstance(batch, Mapping):
            return
        masks = {key: _mask(batch.get(key)) for key in MASK_KEYS}
        if masks["attention_mask"] is None and masks["decoder_attention_mask"] is None:
            return
        if self.encoder_decoder and masks["decoder_attention_mask"] is None:
            value = next(
                (batch[k] for k in DECODER_KEYS if isinstance(batch.get(k), torch.Tensor)), None
            )
            if value is None or value.dim() < 2:
                return  # the decoder's positions are unknown: mask nothing
            masks["decoder_attention_mask"] = torch.ones(
                tuple(value.shape[:2]), dtype=torch.bool, device=value.device
            )
        keeps: dict[tuple[int, ...], torch.Tensor] = {}
        for keep in masks.values():
            if keep is not None:
                shape = tuple(keep.shape)
                keeps[shape] = keep if shape not in keeps else keeps[shape] | keep
        self.keeps = {shape: None if bool(k.all()) else k for shape, k in keeps.items()}
        if all(k is None for k in self.keeps.values()):
            self.keeps = {}

    def clear(self) -> None:
        self.keeps = {}

    def _keep_for(self, lead: tuple[int, ...]) -> torch.Tensor | None:
        """The keep mask for leading dims ``lead`` (``[b, s]`` or ``[b * s]``), or None
        (keep all: no mask of that shape, every position real, or ambiguous)."""
        if len(lead) == 2:
            return self.keeps.get(lead)
        shapes = [shape for shape in self.keeps if shape[0] * shape[1] == lead[0]]
        if len(shapes) != 1:
            return None
        keep = self.keeps[shapes[0]]
        return None if keep is None else keep.reshape(-1)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` (a linear's input, features last) at real tokens."""
        if not self.keeps or x.dim() < 2:
            return x
        lead = tuple(x.shape[:2]) if x.dim() > 2 else (x.shape[0],)
        keep = self._keep_for(lead)
        if keep is None and x.dim() > 2 and lead not in self.keeps:
            keep = self._keep_for((x.shape[0],))  # [batch * seq, k, features]
        return x if keep is None else x[keep.to(x.device)]

    def tokens(self, num_tokens: int) -> torch.Tensor | None:
        """``[num_tokens]`` keep mask when the tokens are the batch's, flattened; else None."""
        if not self.keeps:
            return None
        return self._keep_for((num_tokens,))
