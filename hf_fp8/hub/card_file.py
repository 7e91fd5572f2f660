"""Read and replace a folder's ``README.md`` without following it anywhere (DESIGN §8).

Every card hf_fp8 reads from a folder (``push_folder``, ``save_pretrained``, ``push_to_hub``,
``write_model_card``, the card of the folder a model was loaded from) goes through
:func:`read_card`, and every card it writes into an existing folder through :func:`write_card`:

* the path is ``contained(folder, "README.md")``: a symlink raises ``UnsafePathError``
  (a Hub cache snapshot's link into its own ``blobs/`` excepted, as for the weights);
* the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (a link swapped in after the check is
  refused, a FIFO never blocks) and must be a regular file: a FIFO, a device or a folder named
  ``README.md`` is refused;
* at most :data:`MAX_CARD_BYTES` are read; a larger file is refused unread;
* a new card replaces the old one by a rename, never by writing through it.

A hard link is a regular file (it has no target to follow) and is read like the weights are.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from hf_fp8.serialization.checkpoint import CARD_NAME
from hf_fp8.utils.folders import UnsafePathError, contained, hub_cache_root

# The largest model card hf_fp8 reads: long Hub cards are tens of KiB, a few reach ~1 MiB.
MAX_CARD_BYTES = 8 * 2**20
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def card_path(folder: str | os.PathLike) -> Path:
    """``folder/README.md``, checked (not followed) as :func:`read_card` reads it."""
    return contained(folder, CARD_NAME, links_within=hub_cache_root(folder))


def read_card(folder: str | os.PathLike) -> str | None:
    """Text of ``folder/README.md``; ``None`` when there is none (or no folder). Raises
    ``UnsafePathError`` when it is a symlink, not a regular file, larger than
    :data:`MAX_CARD_BYTES` or not UTF-8 text."""
    path = card_path(folder)
    try:
        fd = os.open(path, _FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # ELOOP: a link put there after the check
        if os.path.islink(path):
            raise UnsafePathError(
                f"{path} is a symlink: hf_fp8 does not follow links in a checkpoint folder; "
                "replace it with the file itself"
            ) from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(
                f"{path} is not a regular file (a folder, FIFO or device): hf_fp8 reads the "
                "model card only from a plain README.md; remove it or put the card's text there"
            )
        data = _read(fd, MAX_CARD_BYTES + 1) if info.st_size <= MAX_CARD_BYTES else b""
    finally:
        os.close(fd)
    if info.st_size > MAX_CARD_BYTES or len(data) > MAX_CARD_BYTES:
        raise UnsafePathError(
            f"{path} is {max(info.st_size, len(data))} bytes, more than a model card may have "
            f"({MAX_CARD_BYTES}); hf_fp8 does not read it: shorten it or move it out of the folder"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafePathError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): hf_fp8 reads and "
            "rewrites only a text model card; fix or remove it"
        ) from exc


def _read(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``fd`` (a regular file: no short read before its end)."""
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, min(limit - size, 1 << 20))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def write_card(folder: str | os.PathLike, text: str) -> Path:
    """Put ``text`` into ``folder/README.md`` by writing a temporary file next to it and
    renaming it into place: an existing link or file is replaced, never written through.
    A new card gets ``0o666 & ~umask`` (as ``open()`` gives the weights and config.json); one
    that replaces a regular card keeps that card's mode. Raises ``UnsafePathError`` when the
    path goes through a symlink."""
    path = contained(folder, CARD_NAME)
    old_mode = _old_mode(path)
    fd, tmp = _create_temp(path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if old_mode is not None:
                os.fchmod(f.fileno(), old_mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def _create_temp(parent: Path) -> tuple[int, Path]:
    """A new, empty ``.README.md.<random>.tmp`` in ``parent``, opened for writing, created with
    mode ``0o666`` so the kernel applies the umask (``mkstemp`` would give ``0o600``)."""
    for _ in range(100):
        tmp = parent / f".{CARD_NAME}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, _CREATE | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary card file in {parent}")


def _old_mode(path: Path) -> int | None:
    """The old card's permission bits (its own, not a link target's); ``None`` when there is
    no regular file to replace."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return stat.S_IMODE(info.st_mode) if stat.S_ISREG(info.st_mode) else None
