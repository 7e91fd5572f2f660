"""Reviewer 20: re-saving a folder that holds a mount point (F2), a read-only or unlistable
subfolder (F3), or that has a shared group with setgid (F4). The files and folders of a
re-saved folder are what they were, except the files the save replaced."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from hf_fp8.serialization import atomic
from hf_fp8.serialization.atomic import TMP_MARKER, atomic_folder

REPO = Path(__file__).resolve().parents[2]
_DROP = ("model.safetensors", "model-*-of-*.safetensors")
_NOBODY = 65534


def _tool_works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _run(cmd: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _temps(*folders: Path) -> list[str]:
    return [p.name for f in folders for p in f.iterdir() if TMP_MARKER in p.name]


# -- F2: a folder mounted inside the save folder ----------------------------------------------
_MOUNT_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from hf_fp8.serialization.atomic import atomic_folder

    dest = Path(sys.argv[1])
    inode = dest.stat().st_ino
    (dest / "data" / "inside.txt").write_text("in the mount")  # tmpfs: filled once mounted
    with atomic_folder(dest, drop=["model.safetensors", "model-*-of-*.safetensors"]) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
    print(json.dumps({
        "data": sorted(os.listdir(dest / "data")),
        "top": sorted(p.name for p in dest.iterdir()),
        "weights": (dest / "model.safetensors").read_text(),
        "same_inode": dest.stat().st_ino == inode,
        "left": [p.name for p in dest.parent.iterdir() if ".hf_fp8-tmp-" in p.name],
        "mounted": os.path.ismount(dest / "data") or any(
            line.split()[4] == str(dest / "data") for line in open("/proc/self/mountinfo")
        ),
    }))
    """
)


@pytest.mark.parametrize("kind", ["bind", "tmpfs"])
def test_a_mount_inside_the_folder_is_never_emptied(tmp_path, kind):
    """F2: the swap re-created data/ (a bind mount: same device; a tmpfs: another device) in
    the temporary folder, copied its files, then ``shutil.rmtree`` of the old tree went into
    the still-mounted folder and deleted the mount source's files."""
    if not _tool_works(["unshare", "-rm", "true"]):
        pytest.skip("needs unshare -rm (user and mount namespaces)")
    dest = tmp_path / "out"
    (dest / "data").mkdir(parents=True)
    (dest / "model.safetensors").write_text("old weights")
    (dest / "model-00001-of-00002.safetensors").write_text("old shard")
    shared = tmp_path / "dataset"
    shared.mkdir()
    (shared / "train.jsonl").write_text("precious")
    if kind == "bind":
        mount = 'mount --bind "$1" "$2"'
    else:
        mount = 'mount -t tmpfs none "$2" && cp "$1/train.jsonl" "$2/"'
    script = f'{mount} && shift 2 && exec "$@"'
    mount_args = ["sh", "-c", script, "sh", str(shared), str(dest / "data")]
    got = _run(["unshare", "-rm", *mount_args, sys.executable, "-c", _MOUNT_CHILD, str(dest)])
    assert got == {
        "data": ["inside.txt", "train.jsonl"],
        "top": ["data", "model.safetensors"],
        "weights": "new weights",
        "same_inode": True,  # written in place: the mount point is never moved
        "left": [],
        "mounted": True,
    }
    if kind == "bind":  # the mount source, outside the folder: untouched
        assert sorted(p.name for p in shared.iterdir()) == ["inside.txt", "train.jsonl"]
        assert (shared / "train.jsonl").read_text() == "precious"


def test_a_listed_mount_point_selects_in_folder_mode(tmp_path, monkeypatch):
    """The mount detector (st_dev, or /proc/self/mountinfo for same-device bind mounts)
    stubbed: a subfolder that is a mount point makes the save write in place."""
    dest = tmp_path / "out"
    (dest / "data").mkdir(parents=True)
    (dest / "data" / "train.jsonl").write_text("precious")
    (dest / "model.safetensors").write_text("old weights")
    real = os.path.realpath(dest / "data")
    monkeypatch.setattr(atomic, "_mount_points", lambda: frozenset({real}))
    inode = dest.stat().st_ino
    with atomic_folder(dest, drop=_DROP) as tmp:
        assert tmp.parent == dest  # in-folder mode
        (tmp / "model.safetensors").write_text("new weights")
    assert dest.stat().st_ino == inode
    assert (dest / "data" / "train.jsonl").read_text() == "precious"
    assert (dest / "model.safetensors").read_text() == "new weights"


def test_cleanup_never_enters_a_mount_point(tmp_path, monkeypatch):
    """Removing a temporary folder stops at a mount point inside it (a mount made while the
    save ran): its files stay, the rest goes."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "model.safetensors").write_text("old weights")
    (dest / "sub").mkdir()
    (dest / "sub" / "a.txt").write_text("a")
    seen = {}
    real_exchange = atomic._exchange

    def exchange(a, b):
        done = real_exchange(a, b)
        if done:  # the old tree is now at ``a``: a mount appears in it before the cleanup
            (Path(a) / "mnt").mkdir()
            (Path(a) / "mnt" / "keep.txt").write_text("not ours")
            seen["old"] = Path(a)
            mounts = frozenset({os.path.realpath(Path(a) / "mnt")})
            monkeypatch.setattr(atomic, "_mount_points", lambda: mounts)
        return done

    monkeypatch.setattr(atomic, "_exchange", exchange)
    with atomic_folder(dest, drop=_DROP) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
    if "old" not in seen:
        pytest.skip("no renameat2 exchange on this file system")
    old = seen["old"]
    assert (old / "mnt" / "keep.txt").read_text() == "not ours"
    assert sorted(p.relative_to(old).as_posix() for p in old.rglob("*")) == [
        "mnt",
        "mnt/keep.txt",
    ]
    assert (dest / "sub" / "a.txt").read_text() == "a"


# -- F3 / F4 as another user ------------------------------------------------------------------
_AS_NOBODY = textwrap.dedent(
    """
    import json, os, stat, sys
    from pathlib import Path
    from hf_fp8.serialization.atomic import atomic_folder

    dest, case = Path(sys.argv[1]), sys.argv[2]
    if case != "group":  # a folder of this user with a subfolder it made read-only / private
        dest.mkdir()
        (dest / "model.safetensors").write_text("old weights")
        (dest / "sub").mkdir()
        (dest / "sub" / "notes.txt").write_text("mine")
        (dest / "sub" / "inner").mkdir()
        (dest / "sub").chmod(int(case, 8))
    inode = dest.stat().st_ino
    error = None
    try:
        with atomic_folder(dest, drop=["model.safetensors", "model-*-of-*.safetensors"]) as tmp:
            (tmp / "model.safetensors").write_text("new weights")
            (tmp / "config.json").write_text("{}")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    sub_mode = None
    if (dest / "sub").exists():
        sub_mode = oct(stat.S_IMODE((dest / "sub").stat().st_mode))
        (dest / "sub").chmod(0o700)
    print(json.dumps({
        "error": error,
        "top": sorted(p.name for p in dest.iterdir()),
        "weights": (dest / "model.safetensors").read_text(),
        "sub": sorted(p.name for p in (dest / "sub").iterdir()) if sub_mode else None,
        "sub_mode": sub_mode,
        "same_inode": dest.stat().st_ino == inode,
        "gid": dest.stat().st_gid,
        "mode": oct(stat.S_IMODE(dest.stat().st_mode)),
        "new_gid": (dest / "config.json").stat().st_gid if error is None else None,
        "left": [p.name for p in [*dest.iterdir(), *dest.parent.iterdir()]
                 if ".hf_fp8-tmp-" in p.name],
    }))
    """
)


@pytest.fixture
def public_tmp():
    """A folder under /tmp that uid 65534 can write (pytest's tmp_path is root-only)."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o777)
    yield base
    for p in base.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o700)
    shutil.rmtree(base, ignore_errors=True)


def _as_nobody(dest: Path, case: str) -> dict:
    prefix = ["setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--"]
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not _tool_works([*prefix, "true"]):
        pytest.skip("needs root and setpriv to run the save as another user")
    return _run([*prefix, sys.executable, "-c", _AS_NOBODY, str(dest), case])


@pytest.mark.parametrize("mode", ["555", "000", "300", "500"])
def test_a_read_only_or_unlistable_subfolder_is_kept(public_tmp, mode):
    """F3: a subfolder the user made read-only (0555: PermissionError while linking into the
    copied-mode folder) or cannot list (0000/0300: PermissionError in the walk) failed the
    save, where transformers alone saves. Now saved; the subfolder keeps files and mode."""
    got = _as_nobody(public_tmp / "out", mode)
    assert got["error"] is None
    assert got["top"] == ["config.json", "model.safetensors", "sub"]
    assert got["weights"] == "new weights"
    assert got["sub"] == ["inner", "notes.txt"]
    assert int(got["sub_mode"], 8) == int(mode, 8)
    assert got["left"] == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_resave_keeps_the_group_and_setgid(tmp_path):
    """F4: the swapped-in folder came from mkdtemp (the saver's primary group, no setgid):
    a team folder (group team, 2770) lost its group and the inheritance of new files."""
    dest = tmp_path / "out"
    (dest / "1_Pooling").mkdir(parents=True)
    (dest / "model.safetensors").write_text("old weights")
    (dest / "1_Pooling" / "config.json").write_text("pool")
    for folder in (dest, dest / "1_Pooling"):
        os.chown(folder, -1, _NOBODY)
        folder.chmod(0o2770)
    with atomic_folder(dest, drop=_DROP) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
        (tmp / "new_sub").mkdir()
        (tmp / "new_sub" / "x.json").write_text("x")
    info = dest.stat()
    assert info.st_gid == _NOBODY
    assert stat.S_IMODE(info.st_mode) == 0o2770
    for rel in ("model.safetensors", "new_sub", "new_sub/x.json", "1_Pooling"):
        assert (dest / rel).stat().st_gid == _NOBODY, rel  # as if written into dest itself
    assert (dest / "new_sub").stat().st_mode & stat.S_ISGID
    assert stat.S_IMODE((dest / "1_Pooling").stat().st_mode) == 0o2770
    assert (dest / "1_Pooling" / "config.json").read_text() == "pool"
    assert _temps(dest, tmp_path) == []


def test_a_group_the_saver_is_not_in_selects_in_folder_mode(public_tmp):
    """F4: where the temporary folder cannot be given the folder's group (the saver is not
    in it) the folder is written in place: group, setgid and inode stay."""
    dest = public_tmp / "out"
    dest.mkdir()
    (dest / "model.safetensors").write_text("old weights")
    (dest / "sub").mkdir()
    (dest / "sub" / "notes.txt").write_text("mine")
    for path in (dest, dest / "sub", dest / "sub" / "notes.txt", dest / "model.safetensors"):
        os.chown(path, _NOBODY, 0)
    dest.chmod(0o2775)
    got = _as_nobody(dest, "group")
    assert got["error"] is None
    assert got["same_inode"] is True
    assert got["gid"] == 0 and got["mode"] == "0o2775"
    assert got["new_gid"] == 0  # setgid of the folder itself
    assert got["top"] == ["config.json", "model.safetensors", "sub"]
    assert got["weights"] == "new weights" and got["left"] == []
