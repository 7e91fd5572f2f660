"""Tensor dtypes from a ``.safetensors`` header, without reading tensor data.

The format: 8 bytes little-endian header length ``n``, then ``n`` bytes of JSON
``{name: {"dtype": "F8_E4M3", "shape": [...], "data_offsets": [...]}, "__metadata__": {...}}``.
The header is parsed by safetensors itself (``safe_open``: its length limit, its JSON nesting
limit, its validation, no tensor data read), so what is read here is exactly what the loader
will accept. A file it refuses (not a regular file, a header longer than the file or than
100 MB, deep nesting, lists where a tensor entry belongs …) gives ``None``: not checkable, and
the loader that reads it next reports that in its own words; so does any other error reading
the file (a ``ValueError``, a name that is not UTF-8, R9 2), while an error of safetensors' API
(an ``AttributeError`` …) is let out: it is the check's own failure. No Python object is built
from a header (a hostile one cost a RecursionError or +532 MB before); safetensors' parse costs
what the load that follows costs. A symlink is read like the loader reads it (its target).
"""

from __future__ import annotations

import os
import stat
import struct

from safetensors import SafetensorError, safe_open

# safetensors itself refuses headers over 100 MB
MAX_HEADER_BYTES = 100_000_000


def _header_fits(path: str | os.PathLike) -> bool:
    """A regular file whose 8-byte header length fits in it and in ``MAX_HEADER_BYTES``
    (checked before safetensors maps the file)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_size < 8:
        return False
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
    return size <= min(MAX_HEADER_BYTES, info.st_size - 8)


def tensor_dtypes(path: str | os.PathLike) -> dict[str, str] | None:
    """``{tensor name: safetensors dtype name}`` of the file at ``path``; ``None`` when
    safetensors would not read it (see the module docstring)."""
    try:
        if not _header_fits(path):
            return None
        handle = safe_open(os.fspath(path), "pt")
    except (OSError, SafetensorError, ValueError, struct.error):  # a damaged file (R9 2)
        return None
    with handle as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
