"""Tensor dtypes from a ``.safetensors`` header, without reading (or mapping) tensor data.

The format: 8 bytes little-endian header length ``n``, then ``n`` bytes of JSON
``{name: {"dtype": "F8_E4M3", "shape": [...], "data_offsets": [...]}, "__metadata__": {...}}``.
Only standard library; a file that is not a readable safetensors file gives ``None`` (the
loader that reads it next reports that in its own words).
"""

from __future__ import annotations

import json
import os
import struct

# safetensors itself refuses headers over 100 MB
MAX_HEADER_BYTES = 100_000_000


def tensor_dtypes(path: str | os.PathLike) -> dict[str, str] | None:
    """``{tensor name: safetensors dtype name}`` of the file at ``path``; ``None`` when it
    cannot be read as a safetensors header."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (size,) = struct.unpack("<Q", head)
            if size > MAX_HEADER_BYTES:
                return None
            raw = f.read(size)
        header = json.loads(raw)
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    if not isinstance(header, dict):
        return None
    return {
        name: info["dtype"]
        for name, info in header.items()
        if name != "__metadata__" and isinstance(info, dict) and isinstance(info.get("dtype"), str)
    }
