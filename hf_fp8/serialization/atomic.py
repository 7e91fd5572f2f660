"""Safe paths and atomic folder writes: nothing outside its folder, no half-written checkpoint.

* ``contained(root, relpath)`` (from ``hf_fp8.utils.folders``) resolves a path named by a file
  (a shard in an index, a file to copy or upload) and refuses it unless it lies inside
  ``root``; symlinks are refused (except links into ``links_within``, e.g. a Hub cache
  snapshot's links into its ``blobs/``).
* ``atomic_folder(dest)`` yields an empty temporary folder to write into; on success its files
  land in ``dest``. Files of an existing ``dest`` that the writer did not write (LoRA
  adapters, README, sentence-transformers files …) are kept, unless named in ``drop``. On
  failure ``dest`` is untouched and only the temporary folder is removed. Two modes:

  - *swap* (the default): the temporary folder is a hidden ``.NAME.hf_fp8-tmp-*`` sibling,
    the kept files are hard-linked into it and the two folders are exchanged in one step
    (Linux ``renameat2``). Before anything is written the temporary folder gets ``dest``'s
    group, mode (setgid included) and extended attributes (ACLs); subfolders are re-created
    with their group and mode. A process killed at any moment leaves the old folder or the
    new one, whole (plus a sibling that can be deleted).
  - *in-folder*, where swapping the folder itself would break something: ``dest`` is or
    holds a mount point (another device, or a bind mount in ``/proc/self/mountinfo``), its
    parent is not writable, ``dest`` or an entry in it belongs to another user (the swap
    would change their owner or copy their files), ``dest`` or a subfolder has a group this
    user is not in (or ``dest``'s group cannot be given to the new folder), a subfolder is
    read-only or cannot be listed by this user, or ``dest`` is (or holds) the current
    directory. The temporary folder is ``dest/.hf_fp8-tmp-*``. Before anything is
    renamed, every file to replace or remove is checked (its folder writable, the owner rule
    of a sticky folder); a file that cannot be is named in a ``PermissionError`` and ``dest``
    is untouched (folders this user cannot list are skipped, not searched for stale files).
    Then its files are renamed into ``dest`` one by one (``config.json`` and the weight index
    last) and the stale files of the old save (``drop``) are removed; an error on the way
    puts back every file replaced or removed (kept as hard links until the end). Each file
    appears whole; ``dest`` keeps its inode, owner and mode; other users' files are neither
    copied nor re-owned. A process killed while writing leaves the old save (plus the
    hidden temporary folder); killed during the renames (milliseconds) it can leave a mix of
    old and new files: save again.

A later save into the folder removes the temporary folders that killed saves left (in
``dest`` and beside it): only this user's, named with this host and a process that is gone,
untouched for 5 minutes; never one a running save writes. Removing a temporary folder never
goes into a mount point inside it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fnmatch
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from hf_fp8.utils.folders import UnsafePathError, contained, hub_cache_root  # noqa: F401 (re-export)
from hf_fp8.utils.processes import pid_gone

TMP_MARKER = ".hf_fp8-tmp-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


# -- atomic folder writes --------------------------------------------------------------------
def _libc_exchange() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).renameat2 if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_uint,
        ]
        fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _libc_exchange()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where
    the system or file system cannot."""
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (
        errno.ENOSYS,
        errno.EINVAL,
        errno.ENOTSUP,
        errno.EOPNOTSUPP,
        errno.EXDEV,
    ):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)  # kept as the link it is, never followed
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _dropped(rel: str, drop: Iterable[str]) -> bool:
    """``rel`` (a POSIX path relative to the folder) matches one of ``drop``. A pattern without
    ``/`` names top-level files only (fnmatch's ``*`` also matches ``/``: without this rule
    ``model-*-of-*.safetensors`` would match ``backup/model-00001-of-00002.safetensors``)."""
    return any(
        ("/" in pattern or "/" not in rel) and (rel == pattern or fnmatch.fnmatchcase(rel, pattern))
        for pattern in drop
    )


def _keep_old_files(old: Path, new: Path, drop: tuple[str, ...], prefix: str = "") -> None:
    """Bring every entry of ``old`` that ``new`` lacks into ``new`` (hard links, no copies of
    data), except the relative paths matching ``drop``."""
    for entry in os.scandir(old):
        rel = f"{prefix}{entry.name}"
        if _dropped(rel, drop) or TMP_MARKER in entry.name:
            continue
        src, dst = old / entry.name, new / entry.name
        if entry.is_dir(follow_symlinks=False):
            if dst.is_dir() and not dst.is_symlink():
                _keep_old_files(src, dst, drop, f"{rel}/")
            elif not os.path.lexists(dst):
                dst.mkdir()
                gid = entry.stat(follow_symlinks=False).st_gid
                if dst.stat().st_gid != gid:  # its group (a member's: _in_folder_reason)
                    with suppress(OSError):
                        os.chown(dst, -1, gid)
                _keep_old_files(src, dst, drop, f"{rel}/")
                shutil.copystat(src, dst)  # after filling it: the mode may be read-only
        elif not os.path.lexists(dst):
            _link_or_copy(src, dst)


# The files a loader reads to decide what the folder holds: renamed into place last.
_LAST = ("model.safetensors.index.json", "config.json")


def _unescape_mountinfo(field: bytes) -> str:
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), field))


def _mount_points() -> frozenset[str]:
    """The mount points this process sees (``/proc/self/mountinfo``: also the bind mounts of
    a folder of the same file system, which ``st_dev`` cannot tell); empty where there is no
    such file (then a mount is known by its ``st_dev`` only)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    return frozenset(
        _unescape_mountinfo(fields[4])
        for fields in (line.split(b" ") for line in lines)
        if len(fields) > 4
    )


class _Fence:
    """Tells the folders under ``root`` that are mount points (another device, or listed in
    ``/proc/self/mountinfo``): a walk or a removal never goes into them."""

    def __init__(self, root: Path) -> None:
        self.real = os.path.realpath(root)
        self.dev = os.lstat(root).st_dev
        self.mounts = _mount_points()

    def crosses(self, rel: str, info: os.stat_result) -> bool:
        return info.st_dev != self.dev or os.path.join(self.real, rel) in self.mounts

    def first_inside(self) -> str | None:
        """A mount point strictly inside ``root`` (relative path), if any."""
        inside = sorted(m for m in self.mounts if m.startswith(self.real.rstrip(os.sep) + os.sep))
        return os.path.relpath(inside[0], self.real) if inside else None


def _walk(
    root: Path, *, skip_unreadable: bool = False, fence: _Fence | None = None, _prefix: str = ""
) -> Iterator[tuple[str, bool]]:
    """``(relative POSIX path, is a real directory)`` of every entry under ``root``, parents
    first; symlinks are entries, never followed; temporary folders of hf_fp8 are left out.
    With ``skip_unreadable`` a subfolder that cannot be listed (another user's private folder)
    is an entry without contents instead of a ``PermissionError``; with a ``fence`` a mount
    point is an entry without contents."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except PermissionError:
        if not skip_unreadable:
            raise
        return
    for entry in entries:
        if TMP_MARKER in entry.name:
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        rel = f"{_prefix}{entry.name}"
        yield rel, is_dir
        if is_dir and (fence is None or not fence.crosses(rel, entry.stat(follow_symlinks=False))):
            yield from _walk(
                root / entry.name, skip_unreadable=skip_unreadable, fence=fence, _prefix=f"{rel}/"
            )


def _access(path: Path | str, mode: int) -> bool:
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _in_folder_reason(dest: Path) -> str | None:
    """Why ``dest`` (an existing folder) must be written in place rather than swapped: a swap
    re-creates its subfolders in a new folder and removes the old tree, which must neither
    enter a mount point nor meet a folder it cannot list, fill or remove, and gives the new
    folders this user's owner and groups."""
    if os.path.ismount(dest):
        return "it is a mount point"
    try:
        cwd = Path.cwd().resolve()
    except FileNotFoundError:
        cwd = None
    if cwd is not None and cwd.is_relative_to(dest.resolve()):
        return "it holds the current directory"
    fence = _Fence(dest)
    inside = fence.first_inside()
    if inside is not None:
        return f"{inside} is a mount point"
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    # root may give any group; another user only the groups it is in
    groups = None if uid in (None, 0) else {os.getegid(), *os.getgroups()}
    info = dest.lstat()
    if uid is not None and info.st_uid != uid:
        return "it belongs to another user"
    if groups is not None and info.st_gid not in groups:
        return "its group is not one of this user's"
    folders = [""]
    while folders:
        folder = folders.pop()
        for entry in sorted(os.scandir(dest / folder), key=lambda e: e.name):
            if TMP_MARKER in entry.name:
                continue
            rel = f"{folder}{entry.name}"
            info = entry.stat(follow_symlinks=False)
            if uid is not None and info.st_uid != uid:
                return f"{rel} belongs to another user"
            if not stat.S_ISDIR(info.st_mode):
                continue
            if fence.crosses(rel, info):
                return f"{rel} is a mount point"
            if groups is not None and info.st_gid not in groups:
                return f"the group of {rel} is not one of this user's"
            if not _access(entry.path, os.R_OK | os.W_OK | os.X_OK):
                return f"{rel} is read-only or cannot be listed by this user"
            folders.append(f"{rel}/")
    return None


def _check_replaceable(dest: Path, rels: Iterable[str]) -> None:
    """Raise ``PermissionError`` naming the file when one of ``rels`` (files to write or
    remove in ``dest``) cannot be replaced: its folder is not writable, or is sticky (``+t``)
    and the file belongs to another user. Checked before anything is renamed."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for rel in rels:
        parent_rel, _, name = rel.rpartition("/")
        parent = contained(dest, parent_rel or ".")
        if not parent.is_dir():  # a folder the save creates (its own parent is checked)
            continue
        target = parent / name
        if not _access(parent, os.W_OK | os.X_OK):
            raise PermissionError(
                f"{target}: cannot be replaced, {parent} is not writable by this user; "
                f"nothing in {dest} was changed. Save to another folder, or ask its owner"
            )
        info = parent.stat()
        if uid and info.st_mode & stat.S_ISVTX and os.path.lexists(target):
            owner = target.lstat().st_uid
            if owner != uid and info.st_uid != uid:
                raise PermissionError(
                    f"{target}: belongs to another user (uid {owner}) in a sticky folder "
                    f"(mode +t): only they can replace it; nothing in {dest} was changed. "
                    "Save to another folder, or ask them to remove it"
                )


def _move_in_place(
    staged: Path, dest: Path, written: list[tuple[str, bool]], drop: tuple[str, ...]
) -> None:
    """Rename the ``written`` entries of ``staged`` into ``dest`` one by one (folders made
    first, the files of ``_LAST`` last), then remove the files of ``dest`` matching ``drop``
    that were not written. Never follows a symlink of ``dest``. Everything is checked first
    (:func:`_check_replaceable`); an error during the renames puts back the files replaced
    (kept as hard links in ``staged``) and removes the new ones."""
    names = {rel for rel, _ in written}
    files = sorted((rel for rel, is_dir in written if not is_dir), key=lambda r: (r in _LAST, r))
    stale = [
        rel
        for rel, is_dir in _walk(dest, skip_unreadable=True, fence=_Fence(dest))
        if not is_dir and rel not in names and _dropped(rel, drop)
    ]
    _check_replaceable(dest, [*(rel for rel, _ in written), *stale])
    backup = staged / f"{TMP_MARKER}old"
    backup.mkdir()
    made: list[Path] = []  # folders created in dest
    done: list[tuple[Path, Path | None]] = []  # (target in dest, its old file kept in backup)
    try:
        for rel, is_dir in written:
            if is_dir:
                target = contained(dest, rel)
                if not target.is_dir():
                    target.mkdir()
                    made.append(target)
        for i, rel in enumerate([*files, *stale]):
            parent, _, name = rel.rpartition("/")
            target = contained(dest, parent or ".") / name  # a symlink is replaced, not followed
            kept = backup / str(i) if os.path.lexists(target) else None
            if kept is not None:
                try:
                    if target.is_symlink():
                        raise OSError
                    os.link(target, kept)
                except OSError:  # a link, or a file we may not link: moved aside instead
                    os.rename(target, kept)
            done.append((target, kept))
            if i < len(files):
                os.replace(staged / rel, target)
            else:  # a stale file of the old save: its link in backup goes with staged
                target.unlink(missing_ok=True)
    except BaseException:
        _put_back(done, made, staged)
        raise


def _put_back(done: list[tuple[Path, Path | None]], made: list[Path], staged: Path) -> None:
    """Undo the renames of :func:`_move_in_place`; a file that cannot be put back is named
    and the temporary folder holding it is kept."""
    lost = []
    for target, kept in reversed(done):
        try:
            if kept is None:
                target.unlink(missing_ok=True)
            else:
                os.replace(kept, target)
        except OSError:
            lost.append(f"{target} (old copy: {kept})")
    for folder in reversed(made):
        with suppress(OSError):
            folder.rmdir()
    if lost:  # keep the old copies: renamed so that the caller's cleanup leaves them
        kept_in = staged.with_name(staged.name + "-restore")
        staged.rename(kept_in)
        raise OSError(
            f"the save failed and these files could not be put back: {lost[:4]}; their old "
            f"copies are in {kept_in}"
        )


# A temporary folder is named TMP_MARKER + host + pid + random: a later save can tell the
# leftovers of a killed save (process gone) from the folder of one still writing.
_STALE_AFTER_S = 300.0


def _tmp_prefix() -> str:
    return f"{TMP_MARKER}{socket.gethostname()}-{os.getpid()}-"


def _newest_mtime(folder: Path) -> float:
    newest = folder.lstat().st_mtime
    for entry in os.scandir(folder):
        newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _remove_tree(path: Path) -> None:
    """``shutil.rmtree(path, ignore_errors=True)`` that never goes into a mount point (another
    device, or a bind mount listed in ``/proc/self/mountinfo``): a folder mounted inside a
    temporary folder, and the folders holding it, stay with their files. Each folder is
    opened relative to its parent without following symlinks (a folder swapped for a link
    while this runs is not followed), like ``shutil.rmtree``."""
    try:
        fence = _Fence(path)
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW

    def empty(fd: int, rel: str) -> bool:  # True once everything in the folder is removed
        try:
            with os.scandir(fd) as it:
                entries = list(it)
        except OSError:
            return False
        done = True
        for entry in entries:
            sub = f"{rel}{entry.name}"
            try:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=fd)
                    continue
                child = os.open(entry.name, flags, dir_fd=fd)
                try:
                    if fence.crosses(sub, os.fstat(child)):
                        done = False  # a mount point: left as it is
                        continue
                    cleared = empty(child, f"{sub}/")
                finally:
                    os.close(child)
                if cleared:
                    os.rmdir(entry.name, dir_fd=fd)
                else:
                    done = False
            except OSError:
                done = False
        return done

    try:
        cleared = empty(top, "")
    finally:
        os.close(top)
    if cleared:
        with suppress(OSError):
            os.rmdir(path)


def _remove_stale_temps(folder: Path, lead: str = "") -> None:
    """Remove the temporary folders (``lead`` + ``_tmp_prefix()`` + random) that saves killed
    before they finished left in ``folder``: only this user's, made on this host by a
    process that is gone, unchanged for ``_STALE_AFTER_S`` (a folder a running save, here or
    on another machine sharing the folder, still writes is never one). Never fails a save."""
    pattern = re.compile(re.escape(lead + TMP_MARKER) + r"(?P<host>.+)-(?P<pid>\d+)-[A-Za-z0-9_]+")
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    host = socket.gethostname()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or match["host"] != host or not pid_gone(int(match["pid"])):
            continue
        path = folder / entry.name
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if uid is not None and entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            if time.time() - _newest_mtime(path) < _STALE_AFTER_S:
                continue
        except OSError:
            continue
        _remove_tree(path)


@contextmanager
def atomic_folder(
    dest: str | os.PathLike, *, drop: Iterable[str] | Callable[[Path], Iterable[str]] = ()
) -> Iterator[Path]:
    """Write a folder atomically: ``with atomic_folder(out) as tmp: save_into(tmp)``.

    ``tmp`` is a new empty sibling of ``dest`` (or a hidden folder inside it, see the module
    docstring for when and what that guarantees). When the block succeeds, ``dest`` becomes
    ``tmp``'s files plus the files ``dest`` already had that the block did not write, except
    those matching ``drop`` (relative paths or glob patterns, e.g. stale weight shards; or a
    callable that is given ``tmp`` once the block has run and returns them, so that what is
    dropped can depend on what the block wrote).
    When the block raises (or the process dies), ``dest`` is left as it was and only ``tmp``
    is removed (a killed process leaves ``tmp`` behind). A ``dest`` that is a symlink is
    written through to its target folder.
    """
    dest = Path(dest).expanduser()
    if dest.is_symlink():
        dest = dest.resolve()
    dest = dest.absolute()
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f"{dest} is a file: the output must be a folder")
    created = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    in_folder = dest.is_dir() and _in_folder_reason(dest) is not None
    if dest.is_dir():
        _remove_stale_temps(dest)
    _remove_stale_temps(dest.parent, f".{dest.name}")
    tmp = None
    if not in_folder:
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}{_tmp_prefix()}", dir=dest.parent))
        except PermissionError:  # the parent is not writable: write inside dest
            if not dest.is_dir():
                raise
            in_folder = True
        if tmp is not None and dest.is_dir() and not _take_folder_attributes(tmp, dest):
            tmp.rmdir()  # it cannot have dest's group: write inside dest
            tmp, in_folder = None, True
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(), dir=dest))
    try:
        yield tmp
        patterns = tuple(drop(tmp) if callable(drop) else drop)
        if in_folder:
            _move_in_place(tmp, dest, list(_walk(tmp)), patterns)
        else:
            _commit(tmp, dest, patterns)
    except BaseException:
        _remove_tree(tmp)
        for folder in created:  # the parents made for dest, innermost first, if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    finally:
        if tmp.exists():
            _remove_tree(tmp)


def _take_folder_attributes(tmp: Path, dest: Path) -> bool:
    """Give the empty ``tmp`` (mkdtemp: this user's group, 0700) ``dest``'s group, mode with
    setgid and extended attributes (ACLs) before anything is written into it, so that the
    swapped-in folder and the files written into it get what they would get in ``dest``.
    ``False`` where that is not allowed."""
    info = dest.stat()
    try:
        if tmp.stat().st_gid != info.st_gid:
            os.chown(tmp, -1, info.st_gid)
        shutil.copystat(dest, tmp)  # mode (setgid included) and xattrs: default ACLs
        os.utime(tmp)  # not dest's times: a leftover of a killed save looks as old as it is
        tmp.chmod(stat.S_IMODE(info.st_mode) | stat.S_IRWXU)  # writable until the swap
        got = tmp.stat()
    except OSError:
        return False
    return got.st_gid == info.st_gid and (got.st_mode & stat.S_ISGID) == (
        info.st_mode & stat.S_ISGID
    )


def _commit(tmp: Path, dest: Path, drop: tuple[str, ...]) -> None:
    if not dest.exists():
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700: give the folder the usual mode
        os.rename(tmp, dest)
        return
    written = list(_walk(tmp))
    _keep_old_files(dest, tmp, drop)
    tmp.chmod(stat.S_IMODE(dest.stat().st_mode))
    try:
        if _exchange(tmp, dest):  # dest now holds the new files, tmp the old ones
            _remove_tree(tmp)
            return
    except OSError as exc:  # busy (a mount point) or not allowed: rename file by file
        if exc.errno not in (errno.EBUSY, errno.EACCES, errno.EPERM):
            raise
    _move_in_place(tmp, dest, written, drop)
