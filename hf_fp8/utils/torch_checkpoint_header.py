"""Tensor dtypes of a ``torch.save`` checkpoint (``pytorch_model.bin``), without its tensor data.

A zip-format file (``torch.save``'s format since torch 1.6, what ``save_pretrained`` writes)
keeps the state dict's structure in its ``data.pkl`` record and each storage's bytes in
records of their own. ``torch.load(map_location="meta", weights_only=True)`` unpickles only
``data.pkl``, with torch's restricted unpickler (no code runs, only allow-listed types are
built), and gives meta tensors: no tensor data is read. The loader that follows unpickles the
same record again. Before torch's reader is even constructed (its constructor reads the
``version`` and ``.data/serialization_id`` records whole, R9 3), Python's ``zipfile`` reads the
zip's central directory and the check goes on only when every record torch reads whole is
stored or deflated and, uncompressed, at most ``MAX_PICKLE_BYTES`` (``data.pkl``) or
``MAX_SMALL_RECORD_BYTES`` (the others): a hostile file cannot make the check slow or large.
Never with ``weights_only=False``.

``None`` (not checkable; the loader reports the file in its own words): not a regular file, the
legacy non-zip format (its pickle has no length before it is parsed; torch 2.13 cannot load
fp8 tensors from it at all, so such a load fails rather than loading wrong), a damaged file
(any error reading it: a zip directory Python or torch refuses, a name that is not UTF-8 …,
R9 2), a record over its limit, a result that is not a mapping of names to tensors. A symlink
is read like the loader reads it (its target).
"""

from __future__ import annotations

import os
import stat
import zipfile
from typing import Any

import torch

# data.pkl of a state dict costs ~130 bytes a tensor: 8 MiB is ~60k tensors in one file, and
# unpickles in ~3 s at worst (a hostile pickle of 1-byte opcodes)
MAX_PICKLE_BYTES = 8 * 2**20
# the other records torch reads whole: torch.load's, and the two its reader's constructor reads
# (a few bytes each when torch.save wrote them)
_SMALL_RECORDS = (
    ".format_version",
    "byteorder",
    ".storage_alignment",
    "version",
    ".data/version",
    ".data/serialization_id",
)
MAX_SMALL_RECORD_BYTES = 4096
_PICKLE = "data.pkl"
_ZIP_MAGIC = b"PK\x03\x04"  # what torch.load itself tests (torch.serialization._is_zipfile)
# compressions torch's reader (miniz) inflates; any other fails in torch.load
_COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
# safetensors' names for the dtypes both formats store (lost_config compares these)
_SAFETENSORS_NAMES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


def _record_limit(name: str) -> int | None:
    """The size limit of the record that zip entry ``name`` (``<archive>/<record>``) is, when
    torch reads it whole; its reader looks records up ignoring ASCII case."""
    record = name.partition("/")[2].lower()
    if record == _PICKLE:
        return MAX_PICKLE_BYTES
    return MAX_SMALL_RECORD_BYTES if record in _SMALL_RECORDS else None


def _directory_fits(path: str) -> bool:
    """Python's reading of the zip directory (no record read): one ``data.pkl`` and every
    record torch reads whole stored or deflated and within its limit."""
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    pickles = 0
    for info in infos:
        limit = _record_limit(info.filename)
        if limit is None:
            continue
        if info.file_size > limit or info.compress_type not in _COMPRESSIONS:
            return False
        pickles += info.filename.partition("/")[2].lower() == _PICKLE
    return pickles == 1


def _pickle_fits(path: str) -> bool:
    """A regular zip-format file whose records that torch reads whole are small, by Python's
    reading of its directory and then by torch's (the reader ``torch.load`` opens next)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        return False
    with open(path, "rb") as f:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            return False
    if not _directory_fits(path):
        return False
    reader = torch._C.PyTorchFileReader(path)
    if not reader.has_record(_PICKLE) or reader.get_record_size(_PICKLE) > MAX_PICKLE_BYTES:
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
    except Exception:  # a damaged file (any error reading it, R9 2): unchecked
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
