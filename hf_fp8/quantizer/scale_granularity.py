"""Which block size explains a checkpoint's stored weight-scale shapes (R12 F1).

A block edge ``b`` stores ``ceil(dim / b)`` scales along an axis of ``dim`` elements, so when
``b`` does not divide ``dim`` a whole range of edges gives the same shapes, and each loads a
different model. The advice of a granularity refusal names a block size only when the shapes
of every scaled weight of the checkpoint fix it; otherwise it names the range. The shapes are
read from the headers of every file transformers reads (``.safetensors`` or ``torch.save``
``.bin``, a Hub cache's too); when some cannot be read, no advice is called exact unless the
refused weight alone pins one size per axis (R16 4).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path


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
    weights: Iterable[ScaledWeight], block_size: tuple[int, int], *, complete: bool = True
) -> tuple[str, bool] | None:
    """The block size that explains every stored scale shape of ``weights`` (``block_size``:
    the config's, preferred where it fits). ``(words, exact)``: ``exact`` when the shapes fix
    it (each axis holds one size, or one block covers the whole axis of every weight, where any
    size at least that long gives the same model); otherwise ``words`` names the usual size that
    fits, if any, and the shapes' range. ``complete=False``: ``weights`` are not all of the
    checkpoint's (other shards unreadable, R16 4), so one block over a whole axis fixes nothing
    (a longer weight elsewhere tells the sizes apart); one size per axis still does (the
    checkpoint's block size is among those that give this weight its shape). ``None``: no
    single block size gives these shapes."""
    ranges = block_ranges(weights)
    if any(lo > hi for lo, hi in ranges):
        return None
    chosen, exact = [], True
    for axis, (lo, hi) in enumerate(ranges):
        preferred = (block_size[axis], *USUAL_BLOCK_SIZES)
        if lo == hi or (hi == math.inf and complete):
            chosen.append(_pick((lo, hi), preferred) or lo)
        else:
            exact = False
            chosen.append(_pick((lo, hi), preferred))
    if exact:
        return describe_granularity("block", tuple(chosen)), True
    spans = " x ".join(f"{lo}..{'any' if hi == math.inf else hi}" for lo, hi in ranges)
    unread = "" if complete else " (the other layers' scale shapes could not be read)"
    if None in chosen:
        return (
            "weight_granularity='block' with a block size the shapes do not determine (any "
            f"block_size in {spans} gives them, each a different model){unread}"
        ), False
    return (
        f"{describe_granularity('block', tuple(chosen))} (the usual size that fits) or another "
        f"block_size in {spans}: the shapes do not determine which{unread}, and each loads a "
        "different model"
    ), False


def stored_scaled_weights(files: Iterable[str | os.PathLike]) -> list[ScaledWeight] | None:
    """The ``((out, in), (rows, cols))`` of every 2-D-scaled fp8 weight stored in the
    checkpoint ``files`` (what transformers resolved: ``.safetensors`` or ``torch.save``
    ``.bin`` shards, a Hub cache snapshot's too): ``X.weight`` / ``X.weight_scale``, and
    ``[E, ...]`` experts ``X.<proj>`` / ``X.<proj>_weight_scale``, from the headers (no tensor
    data). ``None`` when there are no files or one cannot be read. Only for a refusal's
    advice."""
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in dict.fromkeys(os.fspath(f) for f in files):
        try:
            found = _file_headers(file)
        except Exception:  # advice only: the refusal stands without it
            found = None
        if found is None:
            return None
        for name, header in found.items():
            headers.setdefault(name, header)
    if not headers:
        return None
    from hf_fp8.serialization.checkpoint import FP8_DTYPE_NAMES  # refusals only

    found_weights = []
    for key, (_dtype, scale) in headers.items():
        codes_key = key.removesuffix("_scale") if key.endswith(".weight_scale") else None
        if codes_key is None and key.endswith("_weight_scale"):
            codes_key = key.removesuffix("_weight_scale")
        codes = headers.get(codes_key) if codes_key else None
        if codes is None or codes[0] not in FP8_DTYPE_NAMES:
            continue
        shape = codes[1]
        if len(scale) == len(shape) >= 2 and scale[:-2] == shape[:-2]:
            found_weights.append((tuple(shape[-2:]), tuple(scale[-2:])))
    return found_weights


def _file_headers(file: str) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """``{name: (safetensors dtype name, shape)}`` of one checkpoint file, read only once the
    package's capped header readers accepted it (``None`` when they do not)."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        from hf_fp8.utils.safetensors_header import tensor_dtypes

        if tensor_dtypes(file) is None:
            return None
        with safe_open(file, "pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
            return {k: (s.get_dtype(), tuple(s.get_shape())) for k, s in slices.items()}
    if file.endswith(".bin"):
        import torch

        from hf_fp8.utils import torch_checkpoint_header as header

        if header.tensor_dtypes(file) is None:  # zip format, small records, meta-loadable
            return None
        loaded = torch.load(file, map_location="meta", weights_only=True)
        return {
            k: (header.dtype_name(v.dtype), tuple(v.shape))
            for k, v in loaded.items()
            if isinstance(k, str) and isinstance(v, torch.Tensor)
        }
    return None


def local_checkpoint_files(root: str) -> list[str] | None:
    """The weight files transformers reads from the local folder ``root`` (the shards of the
    index it reads, or its single file), each inside ``root``; ``None`` for a Hub id or when
    they cannot be told."""
    from hf_fp8.utils.folders import contained, hub_cache_root, read_index, read_index_json

    try:
        folder = Path(root)
        if not root or not folder.is_dir():
            return None
        index = read_index(folder)
        if index is None:
            single = [
                n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).is_file()
            ]
            return [str(folder / single[0])] if single else None
        weight_map = read_index_json(folder / index)["weight_map"]
        links = hub_cache_root(folder)
        real = folder.resolve()
        return [
            str(contained(real, v, links_within=links)) for v in sorted(set(weight_map.values()))
        ]
    except Exception:  # advice only
        return None
