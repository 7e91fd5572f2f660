"""Which block size explains a checkpoint's stored weight-scale shapes (R12 F1).

A block edge ``b`` stores ``ceil(dim / b)`` scales along an axis of ``dim`` elements, so when
``b`` does not divide ``dim`` a whole range of edges gives the same shapes, and each loads a
different model. The advice of a granularity refusal names a block size only when the shapes
of every scaled weight of the checkpoint fix it; otherwise it names the range.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable


def describe_granularity(granularity: str, block_size: tuple[int, int]) -> str:
    block = f", block_size={list(block_size)}" if granularity == "block" else ""
    return f"weight_granularity={granularity!r}{block}"


# block sizes tried, in this order, when the scale shapes allow more than one
USUAL_BLOCK_SIZES = (128, 64, 256, 32)

# A block edge ``b`` of an axis of ``dim`` elements stored as ``count`` scales: ``lo <= b <= hi``
# (``hi`` is ``math.inf`` when ``count == 1``: any ``b >= dim`` gives one block).
BlockRange = tuple[int, float]
# ``((out, in), (rows, cols))``: one weight and the trailing dims of its stored weight scale
ScaledWeight = tuple[tuple[int, int], tuple[int, int]]


def block_range(dim: int, count: int) -> BlockRange:
    """The block edges ``b`` with ``ceil(dim / b) == count``, as ``(lo, hi)``; empty
    (``lo > hi``) when none has."""
    if count < 1 or count > dim:
        return (1, 0)
    return (-(-dim // count), math.inf if count == 1 else (dim - 1) // (count - 1))


def block_ranges(weights: Iterable[ScaledWeight]) -> tuple[BlockRange, BlockRange]:
    """The block sizes that give every weight of ``weights`` its stored scale shape: the
    intersection of their :func:`block_range` per axis (rows, then columns)."""
    ranges = [[1, math.inf], [1, math.inf]]
    for features, counts in weights:
        for axis in (0, 1):
            lo, hi = block_range(features[axis], counts[axis])
            ranges[axis] = [max(ranges[axis][0], lo), min(ranges[axis][1], hi)]
    return (tuple(ranges[0]), tuple(ranges[1]))  # type: ignore[return-value]


def _pick(rng: BlockRange, preferred: Iterable[int]) -> int | None:
    return next((b for b in preferred if rng[0] <= b <= rng[1]), None)


def block_advice(
    weights: Iterable[ScaledWeight], block_size: tuple[int, int]
) -> tuple[str, bool] | None:
    """The block size that explains every stored scale shape of ``weights`` (``block_size``:
    the config's, preferred where it fits). ``(words, exact)``: ``exact`` when the shapes fix
    it (each axis holds one size, or one block covers the whole axis of every weight, where any
    size at least that long gives the same model); otherwise ``words`` names the usual size that
    fits, if any, and the shapes' range. ``None``: no single block size gives these shapes."""
    ranges = block_ranges(weights)
    if any(lo > hi for lo, hi in ranges):
        return None
    chosen, exact = [], True
    for axis, (lo, hi) in enumerate(ranges):
        preferred = (block_size[axis], *USUAL_BLOCK_SIZES)
        if lo == hi or hi == math.inf:
            chosen.append(_pick((lo, hi), preferred) or lo)
        else:
            exact = False
            chosen.append(_pick((lo, hi), preferred))
    if exact:
        return describe_granularity("block", tuple(chosen)), True
    spans = " x ".join(f"{lo}..{'any' if hi == math.inf else hi}" for lo, hi in ranges)
    if None in chosen:
        return (
            "weight_granularity='block' with a block size the shapes do not determine (any "
            f"block_size in {spans} gives them, each a different model)"
        ), False
    return (
        f"{describe_granularity('block', tuple(chosen))} (the usual size that fits) or another "
        f"block_size in {spans}: the shapes do not determine which, and each loads a "
        "different model"
    ), False


def stored_scaled_weights(root: str) -> list[ScaledWeight]:
    """The ``((out, in), (rows, cols))`` of every 2-D-scaled fp8 weight of the local
    checkpoint ``root`` (``X.weight`` / ``X.weight_scale``, and ``[E, ...]`` experts
    ``X.<proj>`` / ``X.<proj>_weight_scale``), from the shard headers (no tensor data); none
    when they cannot be read. Only for a refusal's advice."""
    if not root or not os.path.isdir(root):
        return []
    from hf_fp8.serialization.checkpoint import FP8_DTYPE_NAMES, Checkpoint  # refusals only

    try:
        tensors = Checkpoint(root).tensors()
    except Exception:  # advice only: the refusal stands without it
        return []
    found = []
    for key, scale in tensors.items():
        codes_key = key.removesuffix("_scale") if key.endswith(".weight_scale") else None
        if codes_key is None and key.endswith("_weight_scale"):
            codes_key = key.removesuffix("_weight_scale")
        codes = tensors.get(codes_key) if codes_key else None
        if codes is None or codes.dtype not in FP8_DTYPE_NAMES:
            continue
        if len(scale.shape) == len(codes.shape) >= 2 and scale.shape[:-2] == codes.shape[:-2]:
            found.append((tuple(codes.shape[-2:]), tuple(scale.shape[-2:])))
    return found
