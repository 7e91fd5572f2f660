"""What a loader may read from a local model folder (DESIGN §8): only the folder's own files.

``check_source_folder(root)`` is the CLI's whole-folder rule, run before ``quantize`` /
``inspect`` / ``export`` read (and copy) a folder. ``check_loaded_files(root, files)`` is the
narrower rule of a pre-quantized ``from_pretrained`` (transformers checks no paths): only the
index it reads and the checkpoint files it will read. ``folder_files`` lists a folder's files and refuses symlinks (what ``push``
uploads, what conversions copy). ``contained(root, relpath)`` is the one path rule: inside
the folder, no ``..``, no absolute name, no symlink (except a Hub cache snapshot's links into
its own ``blobs/``, which must be a real folder: :func:`hub_cache_root`). ``check_loaded_keys`` /
``check_shard_keys``: each tensor stored in one shard, the one the index names (shard headers
only, through the capped readers of ``safetensors_header`` / ``torch_checkpoint_header``, imported
when needed). Otherwise standard library only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# What transformers' from_pretrained reads from a local folder, first found wins (5.x).
_LOAD_ORDER = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

# The JSON files of the folder read (root/subfolder) that a model's from_pretrained reads
# besides the weights: its config (before the quantizer runs) and, for a generative model,
# its generation config (after the weights load). Neither may be a symlink (R22 F5).
LOADED_CONFIGS = ("config.json", "generation_config.json")

# A weight index larger than this is not one save_pretrained wrote (DeepSeek-V3's, ~91k
# tensors, is 9 MB): refused unread when it is the index transformers reads, else ignored.
MAX_INDEX_BYTES = 64 * 2**20
# an unsharded weights file (a variant name included), as transformers names it
_SINGLE = re.compile(r"(model|pytorch_model)(\.[^./]+)?\.(safetensors|bin)")
# a Hub cache repo folder: models--org--name, models--gpt2, datasets--…, spaces--…
_HUB_REPO = re.compile(r"(models|datasets|spaces)--[^/\\]+")


class UnsafePathError(ValueError):
    """A path escapes its folder, is absolute, or goes through a symlink."""


class ShardKeyError(ValueError):
    """A checkpoint stores a tensor in two shards, or in a shard its index does not name for
    it: a loader would silently take one of the copies (transformers: the last file read)."""


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
    allowed = None
    if links_within is not None:
        allowed = Path(links_within).absolute()
        if _is_link(allowed):  # the allowed folder is never taken through a link
            raise UnsafePathError(f"{allowed} is a symlink: links into it are not followed")
        allowed = allowed.resolve()
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


def _cache_layout(folder: Path) -> tuple[Path, ...] | None:
    """(repo, snapshots, snapshot, blobs) when ``folder`` is spelled as a Hub cache snapshot
    ``models--org--name/snapshots/<commit>`` next to a ``blobs`` folder; else ``None``."""
    repo = folder.parent.parent
    if folder.parent.name != "snapshots" or not _HUB_REPO.fullmatch(repo.name):
        return None
    return (repo, folder.parent, folder, repo / "blobs") if (repo / "blobs").is_dir() else None


def hub_cache_root(folder: str | os.PathLike) -> Path | None:
    """The repo's ``blobs/`` (its parents resolved) when ``folder`` is a Hub cache snapshot,
    whose files are symlinks into it; else ``None``. Raises ``UnsafePathError`` when the
    cache's repo folder, ``snapshots/``, the snapshot or ``blobs/`` is itself a symlink, as
    spelled or once resolved: the cache never makes one, and a linked ``blobs/`` would let
    the snapshot's links reach any folder."""
    spelled = Path(os.path.abspath(Path(folder).expanduser()))
    layouts = [_cache_layout(spelled), _cache_layout(spelled.resolve())]
    for part in [p for layout in layouts for p in layout or ()]:
        if _is_link(part):
            raise UnsafePathError(
                f"{part} is a symlink: in a Hub cache the repo folder, snapshots/, the "
                "snapshot and blobs/ are real folders, and hf_fp8 does not follow this link; "
                "pass the snapshot's real path (realpath) of an unmodified cache"
            )
    return layouts[1][3] if layouts[1] else None


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
    links_within = hub_cache_root(root)
    root = Path(root).expanduser().resolve()
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


def read_index_json(path: str | os.PathLike) -> Any:
    """The parsed JSON of the weight index ``path``, at most :data:`MAX_INDEX_BYTES` long.
    Raises ``ValueError`` naming the file when it is larger, not UTF-8, not JSON, or nested
    too deep (``RecursionError``) / too large (``MemoryError``) to parse."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise ValueError(
            f"{path} is {size} bytes, more than a weight index may have ({MAX_INDEX_BYTES}); "
            "it is not an index written by save_pretrained: remove or replace it"
        )
    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.read(MAX_INDEX_BYTES + 1))
    except (ValueError, RecursionError, MemoryError) as err:  # JSON and UTF-8 errors too
        raise ValueError(
            f"{path} is not a readable weight index ({type(err).__name__}: {str(err)[:120]}); "
            "download or save the checkpoint again"
        ) from err


def check_source_folder(root: str | os.PathLike) -> None:
    """The CLI's rule (``hf-fp8 quantize`` / ``inspect`` / ``export``, which read and copy the
    whole folder): no symlink among its files (:func:`folder_files`), every file named by a
    weight index (``*.index.json``) inside it (no ``..`` or absolute names), and the files of
    the index transformers reads (:func:`read_index`) all there. Other indexes (a
    ``pytorch_model.bin.index.json`` whose ``.bin`` shards were not downloaded, an index next
    to ``model.safetensors``) are ignored when they do not parse or name missing files, as
    transformers ignores them. Raises ``UnsafePathError`` / ``FileNotFoundError`` /
    ``ValueError`` naming the file. A pre-quantized ``from_pretrained`` checks less:
    :func:`check_loaded_files`."""
    links_within = hub_cache_root(root)
    root = Path(root).expanduser().resolve()
    folder_files(root)
    read = read_index(root)
    for index_path in sorted(root.glob("*.index.json")):
        contained(root, index_path.name, links_within=links_within)
        try:
            index = read_index_json(index_path)
        except ValueError:
            if index_path.name != read:
                continue
            raise
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


def _is_single_file(files: Sequence[str]) -> bool:
    """``files`` is one unsharded weights file (``model.safetensors``, ``pytorch_model.bin``,
    a variant such as ``model.fp16.safetensors``), not the shards of an index."""
    return len(files) == 1 and _SINGLE.fullmatch(os.path.basename(files[0])) is not None


def check_loaded_files(root: str | os.PathLike, files: Sequence[str] | None) -> str:
    """The rule of a pre-quantized ``from_pretrained`` of the local folder ``root``
    (``config.name_or_path`` as the user spelled it): only what transformers reads is checked.

    ``files`` are the checkpoint files transformers resolved, each
    ``os.path.join(root, subfolder, name)`` with ``name`` from the index it read: each must lie
    in ``root`` by a relative name (no ``..``, not absolute), reach it through no symlink
    (except a Hub cache snapshot's links into its ``blobs/``) and exist. The index itself, in
    the folder it was read from, must not be a symlink either, nor that folder's
    ``config.json`` / ``generation_config.json`` (:data:`LOADED_CONFIGS`: transformers read
    the config before the quantizer runs; a linked one is refused here, before any weight
    is read, as ``hf-fp8 inspect`` refuses it). Other files of the tree (another index,
    ``logs/``, linked tokenizer files) are not looked at. Returns the folder transformers
    reads (``root/subfolder``, as spelled). Raises ``UnsafePathError`` /
    ``FileNotFoundError`` naming the file."""
    spelled = os.fspath(root)
    real = Path(spelled).expanduser().resolve()
    links_within = hub_cache_root(spelled)
    prefix = spelled.rstrip("/" + os.sep) + os.sep if spelled.rstrip("/" + os.sep) else spelled
    rels = []
    for file in files or ():
        file = os.fspath(file)
        if not file.startswith(prefix) or os.path.isabs(file[len(prefix) :]):
            raise UnsafePathError(
                f"{file!r} is not inside the folder {real}: the checkpoint's index names it by "
                "an absolute path; files of a checkpoint must be named relative to its folder"
            )
        rel = file[len(prefix) :]
        if not contained(real, rel, links_within=links_within).is_file():
            raise FileNotFoundError(
                f"{file} is named by the checkpoint's index but is not in {real}: the "
                "checkpoint is incomplete; download or save it again"
            )
        rels.append(rel)
    folder = os.path.commonpath([os.path.dirname(rel) or "." for rel in rels]) if rels else "."
    sharded = bool(rels) and not _is_single_file(rels)
    read = folder  # root/subfolder: the index's folder, or the single weights file's
    if sharded:
        kind = "bin" if rels[0].endswith(".bin") else "safetensors"
        read = _check_read_index(real, folder, kind, links_within) or folder
    for name in LOADED_CONFIGS:  # transformers reads them from root/subfolder
        contained(real, os.path.join(read, name), links_within=links_within)
    if not rels:
        return spelled
    if sharded:
        check_loaded_keys([real / rel for rel in rels], root=real)
    return os.path.normpath(os.path.join(spelled, folder))


def _check_read_index(real: Path, folder: str, kind: str, links_within: Path | None) -> str | None:
    """The ``*{kind}.index*.json`` of the nearest folder at or above ``folder`` (relative to
    ``real``) that has one: not a symlink. Only the name is looked at; nothing is parsed.
    Returns that folder (relative to ``real``), ``None`` when none has one."""
    parts = Path(folder).parts if folder not in ("", ".") else ()
    for depth in range(len(parts), -1, -1):
        here = Path(*parts[:depth]) if depth else Path()
        try:
            names = sorted(
                n for n in os.listdir(real / here) if n.endswith(".json") and f"{kind}.index" in n
            )
        except OSError:
            continue
        for name in names:
            contained(real, here / name, links_within=links_within)
        if names:
            return os.fspath(here)
    return None


def shard_tensor_names(path: str | os.PathLike) -> list[str] | None:
    """The tensor names in the header of the checkpoint file ``path`` (``.safetensors``, or a
    ``torch.save`` ``.bin``), read by the package's capped header readers (no tensor data);
    ``None`` when it cannot be read cheaply (:func:`check_loaded_keys` refuses such a shard of
    a sharded pre-quantized checkpoint)."""
    name = os.fspath(path)
    if name.endswith(".safetensors"):
        from hf_fp8.utils.safetensors_header import tensor_dtypes
    elif name.endswith(".bin"):
        from hf_fp8.utils.torch_checkpoint_header import tensor_dtypes
    else:
        return None
    dtypes = tensor_dtypes(name)
    return None if dtypes is None else list(dtypes)


def check_shard_keys(
    keys_by_file: Mapping[str, Iterable[str]],
    weight_map: Mapping[str, str] | None = None,
    *,
    where: str = "the checkpoint",
    index: str = "the index",
) -> None:
    """Each tensor of ``keys_by_file`` (``{shard name: tensor names in its header}``) stored
    once, and, with ``weight_map`` (the index's ``{tensor: shard name}``, names spelled alike),
    in the shard the index names for it. Raises ``ShardKeyError`` naming the tensor, both files
    and ``where`` (the folder). A loader reads every key of every shard it opens and keeps the
    last copy of a name, whatever the index says."""
    seen: dict[str, str] = {}
    for file, keys in keys_by_file.items():
        for key in keys:
            first = seen.setdefault(key, file)
            if first == file:
                continue
            named = weight_map.get(key) if weight_map is not None else None
            says = f"; {index} names {named}" if named else ""
            raise ShardKeyError(
                f"{key} is stored in two files of {where}, {first} and {file}{says}: a loader "
                "would silently keep one of the copies (the last file read). The checkpoint "
                "was altered after it was saved; remove the copy the index does not name, or "
                "download or save the checkpoint again"
            )
    if weight_map is None:
        return
    for key, file in seen.items():
        named = weight_map.get(key)
        if named != file:
            says = f"names {named} for it" if named else "does not list it"
            raise ShardKeyError(
                f"{key} is stored in {file} of {where}, but {index} {says}: the shards and "
                "the index disagree (the checkpoint was altered after it was saved); "
                "download or save the checkpoint again"
            )


def _matching_index(
    files: Sequence[Path], folders: Sequence[Path]
) -> tuple[Path, dict[str, str]] | None:
    """The weight index (``*.index*.json`` in the first of ``folders`` that has one whose
    ``weight_map`` names exactly ``files``) and its map; ``None`` when none does."""
    wanted = {os.path.normpath(f) for f in files}
    for folder in folders:
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and ".index" in n)
        except OSError:
            continue
        for name in names:
            try:
                index = read_index_json(folder / name)
            except (OSError, ValueError):
                continue
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                continue
            named = {os.path.normpath(folder / v) for v in set(weight_map.values())}
            if named == wanted:
                return folder / name, weight_map
    return None


def check_loaded_keys(
    files: Sequence[str | os.PathLike], *, root: str | os.PathLike | None = None
) -> None:
    """The rule of a pre-quantized ``from_pretrained`` on the shards it reads (``files``,
    absolute, as the loader resolved them, a Hub cache snapshot's too): every tensor stored in
    one shard only, the one the weight index names (the index found next to the shards, or in a
    folder above them up to ``root``, that names exactly these files; without one, only the
    duplicates are refused). Only the shard headers are read. The readable shards are checked
    first; then a shard whose names cannot be read cheaply (:func:`shard_tensor_names`: a
    legacy-format or oversized ``.bin``, a damaged file) is refused, named: a copy in it would
    go unseen (R16 1). hf_fp8 and transformers 5.x write safetensors, and torch cannot store
    fp8 in its legacy format, so no FP8 checkpoint they wrote is refused. Raises
    ``ShardKeyError`` (:func:`check_shard_keys`)."""
    paths = [Path(os.path.abspath(os.fspath(f))) for f in files]
    if len(paths) < 2:
        return
    common = Path(os.path.commonpath([p.parent for p in paths]))
    folders = [common]
    if root is not None:
        top = Path(os.path.abspath(os.fspath(root)))
        while folders[-1] != top and folders[-1].is_relative_to(top):
            folders.append(folders[-1].parent)
    found = _matching_index(paths, folders)
    base = found[0].parent if found else common
    keys_by_file: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for path in dict.fromkeys(paths):  # ``x`` and ``./x`` of one index: one file
        names = shard_tensor_names(path)
        rel = os.path.relpath(path, base).replace(os.sep, "/")
        if names is None:
            unreadable.append(rel)
        else:
            keys_by_file[rel] = names
    weight_map = None
    if found:
        spelled = {v: os.path.normpath(v).replace(os.sep, "/") for v in set(found[1].values())}
        weight_map = found[1]
        if any(a != b for a, b in spelled.items()):  # ``./x`` spelled as the file is
            weight_map = {k: spelled[v] for k, v in weight_map.items()}
    check_shard_keys(
        keys_by_file,
        weight_map,
        where=str(base),
        index=found[0].name if found else "the index",
    )
    if unreadable:
        raise ShardKeyError(_unreadable_shard(unreadable[0], base))


def _unreadable_shard(file: str, base: Path) -> str:
    """The refusal of a shard of a pre-quantized checkpoint whose tensor names cannot be read
    cheaply: another shard may hold a copy of one of its tensors, which the loader would take
    silently (R16 1)."""
    if file.endswith(".safetensors"):
        why = "it is not a readable safetensors file (damaged or incomplete)"
        fix = "download or save the checkpoint again"
    else:
        why = (
            "it is not a torch.save zip file whose state dict's pickle is at most "
            "8 MiB (torch's legacy format, an oversized pickle, or a damaged file)"
        )
        fix = (
            "re-save the shards as safetensors (safetensors.torch.save_file of each shard's "
            "torch.load(..., weights_only=True), and a model.safetensors.index.json naming "
            "them: what save_pretrained writes), or download or save the checkpoint again"
        )
    return (
        f"{file} of {base}: its tensor names cannot be read, because {why}, so hf_fp8 cannot "
        "check that no tensor of this sharded FP8 checkpoint is stored in two shards (a "
        f"loader would silently keep the last copy read); {fix}"
    )


def check_files_inside(root: str | os.PathLike, files: list[str] | None) -> None:
    """Every path of ``files`` (what a loader resolved: shards, a ``subfolder``'s weights)
    lies inside ``root`` and reaches it through no symlink; raises ``UnsafePathError``
    naming the file."""
    spelled = os.path.abspath(Path(root).expanduser())  # as the loader joined the names
    real = Path(spelled).resolve()
    links_within = hub_cache_root(spelled)
    for file in files or ():
        rel = os.path.relpath(os.path.abspath(file), spelled)
        # ``sub/../x`` is normalized away here, but opened through ``sub`` (maybe a link)
        if ".." in Path(file).parts or rel == ".." or rel.startswith(("../", "..\\")):
            raise UnsafePathError(f"{file!r} lies outside the folder {real}")
        contained(real, rel, links_within=links_within)


__all__ = [
    "LOADED_CONFIGS",
    "MAX_INDEX_BYTES",
    "ShardKeyError",
    "UnsafePathError",
    "check_files_inside",
    "check_loaded_files",
    "check_loaded_keys",
    "check_shard_keys",
    "check_source_folder",
    "contained",
    "folder_files",
    "hub_cache_root",
    "read_index",
    "read_index_json",
    "shard_tensor_names",
]
