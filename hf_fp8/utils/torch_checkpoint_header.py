"""Tensor dtypes of a ``torch.save`` checkpoint (``pytorch_model.bin``), without its tensor data.

A zip-format file (``torch.save``'s format since torch 1.6, what ``save_pretrained`` writes)
keeps the state dict's structure in its ``data.pkl`` record and each storage's bytes in
records of their own. ``torch.load(map_location="meta", weights_only=True)`` unpickles only
``data.pkl``, with torch's restricted unpickler (no code runs, only allow-listed types are
built), and gives meta tensors: no tensor data is read. The loader that follows unpickles the
same record again; this check reads it only when the zip directory says it is at most
``MAX_PICKLE_BYTES`` and the few other records ``torch.load`` reads whole are tiny (a hostile
file cannot make the check slow or large), and never with ``weights_only=False``.

``None`` (not checkable; the loader reports the file in its own words): not a regular file, the
legacy non-zip format (its pickle has no length before it is parsed; torch 2.13 cannot load
fp8 tensors from it at all, so such a load fails rather than loading wrong), a file torch
refuses, a ``data.pkl`` over the limit, a result that is not a mapping of names to tensors.
A symlink is read like the loader reads it (its target).
"""

from __future__ import annotations

import os
import stat
from typing import Any

import torch

# data.pkl of a state dict costs ~130 bytes a tensor: 8 MiB is ~60k tensors in one file, and
# unpickles in ~3 s at worst (a hostile pickle of 1-byte opcodes)
MAX_PICKLE_BYTES = 8 * 2**20
# the other records torch.load reads whole (a few bytes each when torch.save wrote them)
_SMALL_RECORDS = (".format_version", "byteorder", ".storage_alignment")
MAX_SMALL_RECORD_BYTES = 4096
_ZIP_MAGIC = b"PK\x03\x04"  # what torch.load itself tests (torch.serialization._is_zipfile)
# safetensors' names for the dtypes both formats store (lost_config compares these)
_SAFETENSORS_NAMES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


def _pickle_fits(path: str) -> bool:
    """A regular zip-format file whose ``data.pkl`` record is at most ``MAX_PICKLE_BYTES`` and
    whose other records that ``torch.load`` reads whole are small."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        return False
    with open(path, "rb") as f:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            return False
    try:  # the reader torch.load opens next: its zip directory, no record read
        reader = torch._C.PyTorchFileReader(path)
    except RuntimeError:
        return False  # not a zip torch reads
    if not reader.has_record("data.pkl") or reader.get_record_size("data.pkl") > MAX_PICKLE_BYTES:
        return False
    return all(
        reader.get_record_size(name) <= MAX_SMALL_RECORD_BYTES
        for name in _SMALL_RECORDS
        if reader.has_record(name)
    )


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` (``F8_E4M3``), else torch's (``float8_e4m3fnuz``)."""
    return _SAFETENSORS_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def tensor_dtypes(path: str | os.PathLike) -> dict[str, str] | None:
    """``{tensor name: dtype name}`` (see :func:`dtype_name`) of the torch checkpoint at
    ``path``; ``None`` when it cannot be read cheaply and safely (see the module docstring)."""
    path = os.fspath(path)
    try:
        if not _pickle_fits(path):
            return None
    except OSError:
        return None
    try:
        loaded: Any = torch.load(path, map_location="meta", weights_only=True)
    except Exception:  # any refusal of a hostile or damaged pickle: unchecked
        return None
    if not isinstance(loaded, dict):
        return None
    return {
        name: dtype_name(value.dtype)
        for name, value in loaded.items()
        if isinstance(name, str) and isinstance(value, torch.Tensor)
    }
