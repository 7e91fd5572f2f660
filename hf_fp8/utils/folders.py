"""What a loader may read from a local model folder (DESIGN §8): only the folder's own files.

``check_source_folder(root)`` is run before a loader that does not check paths itself
(transformers' ``from_pretrained``) reads a folder: by the CLI's ``quantize`` / ``inspect`` /
``export`` and by the quantizer when ``from_pretrained`` loads a pre-quantized hf_fp8
checkpoint. ``folder_files`` lists a folder's files and refuses symlinks (what ``push``
uploads, what conversions copy). ``contained(root, relpath)`` is the one path rule: inside
the folder, no ``..``, no absolute name, no symlink (except a Hub cache snapshot's links into
its own ``blobs/``). Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

# What transformers' from_pretrained reads from a local folder, first found wins (5.x).
_LOAD_ORDER = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class UnsafePathError(ValueError):
    """A path escapes its folder, is absolute, or goes through a symlink."""


def _is_link(path: Path) -> bool:
    return path.is_symlink() or (hasattr(path, "is_junction") and path.is_junction())


def contained(
    root: str | os.PathLike,
    relpath: str | os.PathLike,
    *,
    links_within: str | os.PathLike | None = None,
) -> Path:
    """``root / relpath`` resolved; raises ``UnsafePathError`` when ``relpath`` is absolute,
    leaves ``root`` (``..``), or passes through a symlink. With ``links_within``, a symlink
    whose target lies inside that folder is allowed (Hub cache snapshots link into ``blobs/``).
    The path need not exist."""
    base = Path(root).resolve()
    rel = Path(relpath)
    text = os.fspath(relpath)
    if rel.is_absolute() or rel.drive or text.startswith(("/", "\\")):
        raise UnsafePathError(
            f"{text!r} is an absolute path; files of {base} must be named relative to it"
        )
    allowed = Path(links_within).resolve() if links_within is not None else None
    current = base
    for part in rel.parts:
        if part in ("", "."):
            continue
        if part == "..":
            raise UnsafePathError(f"{text!r} leaves the folder {base} ('..' is not allowed)")
        current = current / part
        if _is_link(current):
            target = current.resolve()
            if allowed is None or not target.is_relative_to(allowed):
                raise UnsafePathError(
                    f"{current} is a symlink: hf_fp8 does not follow links in a checkpoint "
                    "folder; replace it with the file itself"
                )
            current = target
    final = current.resolve()
    if not (final.is_relative_to(base) or (allowed is not None and final.is_relative_to(allowed))):
        raise UnsafePathError(f"{text!r} resolves outside the folder {base}")
    return current


def hub_cache_root(folder: str | os.PathLike) -> Path | None:
    """The repo folder (``models--org--name``) when ``folder`` is a Hub cache snapshot, whose
    files are symlinks into the repo's ``blobs/``; else ``None``."""
    folder = Path(folder).resolve()
    repo = folder.parent.parent
    if folder.parent.name == "snapshots" and (repo / "blobs").is_dir():
        return repo / "blobs"
    return None


def _walk(root: Path) -> Iterator[str]:
    """Relative POSIX paths of the entries under ``root``, hidden ones left out; linked
    folders are yielded, not entered."""
    for folder, dirs, names in os.walk(root):
        rel_folder = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in [*dirs, *sorted(names)]:
            if not name.startswith("."):
                yield (rel_folder / name).as_posix()


def folder_files(
    root: str | os.PathLike, *, keep: Callable[[str], bool] | None = None
) -> list[str]:
    """Every file under ``root`` (POSIX paths relative to it) for which ``keep`` holds, hidden
    files and folders left out: what ``push`` uploads and conversions copy. A symlink among
    them raises ``UnsafePathError``: hf_fp8 never reads, copies or uploads a link target (a Hub
    cache snapshot's links into its own ``blobs/`` are the cache's layout and allowed)."""
    root = Path(root).expanduser().resolve()
    links_within = hub_cache_root(root)
    found = []
    for rel in _walk(root):
        if keep is not None and not keep(rel):
            continue
        if contained(root, rel, links_within=links_within).is_file():
            found.append(rel)
    return sorted(found)


def read_index(root: Path) -> str | None:
    """The weight index transformers will read from ``root`` (``None``: a single file, or
    nothing it knows): the first of ``_LOAD_ORDER`` present decides."""
    first = next((name for name in _LOAD_ORDER if (root / name).is_file()), None)
    return first if first is not None and first.endswith(".index.json") else None


def check_source_folder(root: str | os.PathLike) -> None:
    """Check a local model folder before a loader that does not check paths (transformers'
    ``from_pretrained``) reads it: no symlink among its files (:func:`folder_files`), every
    file named by a weight index (``*.index.json``) inside it (no ``..`` or absolute names),
    and the files of the index transformers reads (:func:`read_index`) all there. Other
    indexes (a ``pytorch_model.bin.index.json`` whose ``.bin`` shards were not downloaded, an
    index next to ``model.safetensors``) are ignored, as transformers does. Raises
    ``UnsafePathError`` / ``FileNotFoundError`` naming the file."""
    root = Path(root).expanduser().resolve()
    links_within = hub_cache_root(root)
    folder_files(root)
    read = read_index(root)
    for index_path in sorted(root.glob("*.index.json")):
        contained(root, index_path.name, links_within=links_within)
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            if index_path.name != read:
                continue
            raise ValueError(f"{index_path.name} is not valid JSON ({err})") from err
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            continue
        for file in sorted({v for v in weight_map.values() if isinstance(v, str)}):
            path = contained(root, file, links_within=links_within)
            if index_path.name == read and not path.is_file():
                raise FileNotFoundError(
                    f"{index_path.name} names {file}, which is not in {root}: the checkpoint "
                    "is incomplete; download or save it again"
                )


def check_files_inside(root: str | os.PathLike, files: list[str] | None) -> None:
    """Every path of ``files`` (what a loader resolved: shards, a ``subfolder``'s weights)
    lies inside ``root`` and reaches it through no symlink; raises ``UnsafePathError``
    naming the file."""
    spelled = os.path.abspath(Path(root).expanduser())  # as the loader joined the names
    real = Path(spelled).resolve()
    links_within = hub_cache_root(real)
    for file in files or ():
        rel = os.path.relpath(os.path.abspath(file), spelled)
        if rel == ".." or rel.startswith(("../", "..\\")):
            raise UnsafePathError(f"{file!r} lies outside the folder {real}")
        contained(real, rel, links_within=links_within)


__all__ = [
    "UnsafePathError",
    "check_files_inside",
    "check_source_folder",
    "contained",
    "folder_files",
    "hub_cache_root",
    "read_index",
]
