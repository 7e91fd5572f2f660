"""atomic_folder: all-or-nothing folder writes; contained: no path leaves its folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.serialization.atomic import (
    TMP_MARKER,
    UnsafePathError,
    atomic_folder,
    contained,
    hub_cache_root,
)

REPO = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _temps(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if TMP_MARKER in p.name]


# -- atomic_folder ----------------------------------------------------------------------------
def test_new_folder_appears_whole(tmp_path):
    dest = tmp_path / "a" / "out"
    with atomic_folder(dest) as tmp:
        assert tmp.parent == dest.parent and not dest.exists()
        (tmp / "x.txt").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "y.txt").write_text("y")
    assert _tree(dest) == {"x.txt": b"new", "sub/y.txt": b"y"}
    umask = os.umask(0)
    os.umask(umask)
    assert (dest.stat().st_mode & 0o777) == 0o777 & ~umask  # not mkdtemp's 0700
    assert _temps(dest.parent) == []


def test_existing_folder_keeps_what_was_not_written(tmp_path):
    dest = tmp_path / "out"
    (dest / "1_Pooling").mkdir(parents=True)
    (dest / "1_Pooling" / "config.json").write_text("pool")
    (dest / "adapter_model.safetensors").write_text("lora")
    (dest / "README.md").write_text("mine")
    (dest / "model.safetensors").write_text("old weights")
    (dest / "model-00001-of-00002.safetensors").write_text("old shard")
    (dest / "link").symlink_to("/etc/hostname")
    mode = 0o750
    dest.chmod(mode)
    with atomic_folder(dest, drop=["model-*-of-*.safetensors"]) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "extra.json").write_text("e")
    assert _tree(dest) == {
        "1_Pooling/config.json": b"pool",
        "1_Pooling/extra.json": b"e",
        "README.md": b"mine",
        "adapter_model.safetensors": b"lora",
        "model.safetensors": b"new weights",
        "link": Path("/etc/hostname").read_bytes(),
    }
    assert (dest / "link").is_symlink()  # kept as the link, never copied through
    assert (dest.stat().st_mode & 0o777) == mode
    assert _temps(tmp_path) == []


@pytest.mark.parametrize("exists", [True, False])
def test_failure_leaves_dest_untouched(tmp_path, exists):
    dest = tmp_path / "out"
    if exists:
        dest.mkdir()
        (dest / "model.safetensors").write_text("old")
    before = _tree(dest) if exists else None
    with pytest.raises(RuntimeError, match="boom"), atomic_folder(dest) as tmp:
        (tmp / "model.safetensors").write_text("half")
        raise RuntimeError("boom")
    assert (_tree(dest) if exists else dest.exists()) == (before if exists else False)
    assert _temps(tmp_path) == []


def test_failure_removes_the_parents_it_made(tmp_path):
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "a" / "b" / "out"):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_symlinked_dest_is_written_through(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("k")
    (tmp_path / "alias").symlink_to(real)
    with atomic_folder(tmp_path / "alias") as tmp:
        (tmp / "new.txt").write_text("n")
    assert (tmp_path / "alias").is_symlink()
    assert _tree(real) == {"keep.txt": b"k", "new.txt": b"n"}


def test_dest_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"), atomic_folder(tmp_path / "f"):
        pass


# -- contained --------------------------------------------------------------------------------
def test_contained_accepts_paths_inside(tmp_path):
    (tmp_path / "sub").mkdir()
    assert contained(tmp_path, "sub/a.safetensors") == tmp_path.resolve() / "sub/a.safetensors"
    assert contained(tmp_path, "./b.json") == tmp_path.resolve() / "b.json"


@pytest.mark.parametrize(
    "bad", ["../victim.safetensors", "./../../x/victim.safetensors", "sub/../../x", "/etc/passwd"]
)
def test_contained_refuses_escapes(tmp_path, bad):
    (tmp_path / "sub").mkdir()
    with pytest.raises(UnsafePathError, match=r"absolute|leaves the folder"):
        contained(tmp_path / "sub", bad)


def test_contained_refuses_symlinks(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("s")
    (root / "file.safetensors").symlink_to(outside / "secret")
    (root / "dir").symlink_to(outside)
    (root / "inner").symlink_to(root / "file.safetensors")
    for rel in ("file.safetensors", "dir/secret", "inner"):
        with pytest.raises(UnsafePathError, match="is a symlink"):
            contained(root, rel)


def test_contained_allows_links_into_hub_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "blobs" / "123").write_text("w")
    (repo / "snapshots" / "abc" / "model.safetensors").symlink_to("../../blobs/123")
    (repo / "snapshots" / "abc" / "evil").symlink_to(tmp_path)
    snap = repo / "snapshots" / "abc"
    blobs = hub_cache_root(snap)
    assert blobs == (repo / "blobs").resolve()
    assert contained(snap, "model.safetensors", links_within=blobs).read_text() == "w"
    with pytest.raises(UnsafePathError, match="symlink"):
        contained(snap, "evil", links_within=blobs)
    assert hub_cache_root(tmp_path) is None


# -- a killed save over an existing checkpoint --------------------------------------------------
_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import hf_fp8
    from hf_fp8.serialization import atomic
    from transformers import AutoModelForCausalLM

    src, dest, stage = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=hf_fp8.Fp8Config("weight_only")
    )

    def hang(name):
        print(name, flush=True)
        time.sleep(600)

    real = atomic._exchange

    def exchange(a, b):  # only the final swap into dest (save_pretrained may nest one)
        final = Path(b).resolve() == Path(dest).resolve()
        if final and stage == "before-exchange":
            hang(stage)
        done = real(a, b)
        if final and stage == "after-exchange":
            hang(stage)
        return done

    atomic._exchange = exchange
    if stage.startswith("cwd-"):  # the folder is the current directory: written in place
        os.chdir(dest)
    with atomic.atomic_folder(dest) as tmp:
        model.save_pretrained(tmp)
        if stage.endswith("mid-write"):
            weights = tmp / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
            hang(stage)
    print("done", flush=True)
    """
)


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
def test_killed_save_leaves_old_or_new_checkpoint(tmp_path, tiny_model_dir):
    src = tiny_model_dir("llama")
    old_model = AutoModelForCausalLM.from_pretrained(src, quantization_config=Fp8Config("dynamic"))
    stages = {
        "mid-write": "old",
        "before-exchange": "old",
        "after-exchange": "new",
        "cwd-mid-write": "old",
    }
    dests = {}
    for stage in stages:
        dests[stage] = tmp_path / stage
        old_model.save_pretrained(dests[stage])
        (dests[stage] / "adapter_model.safetensors").write_text("lora")
    old = _state(dests["mid-write"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_FP8_COMPILE": "0", "PYTHONPATH": str(REPO)}
    procs = {
        stage: subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(src), str(dests[stage]), stage],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for stage in stages
    }
    for stage, proc in procs.items():
        line = proc.stdout.readline().strip()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert line == stage, f"child never reached {stage}"
    new_model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=Fp8Config("weight_only")
    )
    new = new_model.state_dict()
    for stage, expected in stages.items():
        dest = dests[stage]
        loaded = AutoModelForCausalLM.from_pretrained(dest)  # loadable, as hf_fp8 model
        scheme = loaded.config.quantization_config.activation_scheme
        assert scheme == ("dynamic" if expected == "old" else "weight_only"), stage
        want = old if expected == "old" else new
        got = _state(dest)
        assert got.keys() <= want.keys() and len(got) > 0
        for key, value in got.items():
            assert torch.equal(value.view(torch.uint8), want[key].view(torch.uint8)), key
        assert (dest / "adapter_model.safetensors").read_text() == "lora"


# -- folders that cannot be swapped: written in place (reviewer) --------------------------------
_SAVE = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from hf_fp8.serialization.atomic import atomic_folder

    dest = Path(sys.argv[1])
    if len(sys.argv) > 2:  # fill a fresh folder (a new mount) with an old save first
        (dest / "model.safetensors").write_text("old weights")
        (dest / "model-00001-of-00002.safetensors").write_text("old shard")
        (dest / "notes.txt").write_text("mine")
    inode = dest.stat().st_ino
    with atomic_folder(dest, drop=["model.safetensors", "model-*-of-*.safetensors"]) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
        (tmp / "config.json").write_text("{}")
    tree = {p.name: p.read_text() for p in dest.iterdir()}
    temps = [p for p in [*dest.iterdir(), *dest.parent.iterdir()] if ".hf_fp8-tmp-" in p.name]
    print(json.dumps({"tree": tree, "same_inode": dest.stat().st_ino == inode,
                      "temps": [str(p) for p in temps]}))
    """
)
_NEW = {"model.safetensors": "new weights", "config.json": "{}", "notes.txt": "mine"}


def _old_save(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "model.safetensors").write_text("old weights")
    (dest / "model-00001-of-00002.safetensors").write_text("old shard")
    (dest / "notes.txt").write_text("mine")
    return dest


def _save_in_child(prefix: list[str], dest: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [*prefix, sys.executable, "-c", _SAVE, str(dest), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tool_works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_mount_point_is_written_in_place(tmp_path):
    """Reviewer: a folder that is a mount point (a Docker/K8s volume) cannot be swapped:
    the save failed with EBUSY where transformers' own save succeeds."""
    if not _tool_works(["unshare", "-rm", "true"]):
        pytest.skip("needs unshare -rm (user and mount namespaces)")
    dest = tmp_path / "vol"
    dest.mkdir()
    script = 'mount -t tmpfs none "$1" && shift && exec "$@"'
    got = _save_in_child(["unshare", "-rm", "sh", "-c", script, "sh", str(dest)], dest, "fill")
    assert got == {"tree": _NEW, "same_inode": True, "temps": []}


def test_folder_with_a_read_only_parent_is_written_in_place(tmp_path):
    """Reviewer: a writable folder in a read-only parent (a team folder): the temporary
    sibling could not be made (PermissionError)."""
    dest = _old_save(tmp_path / "team" / "out")
    dest.chmod(0o777)
    dest.parent.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:  # root ignores the mode: drop the capabilities that override it
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
        prefix += ["--inh-caps", "-all", "--"]
        if not _tool_works([*prefix, "true"]):
            pytest.skip("needs setpriv to drop root's capabilities")
    try:
        got = _save_in_child(prefix, dest)
    finally:
        dest.parent.chmod(0o755)
    assert got == {"tree": _NEW, "same_inode": True, "temps": []}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_shared_folder_keeps_its_owners(tmp_path):
    """Reviewer: in a shared folder holding another user's files the swap re-owned the folder
    and the files it kept (copies), and failed on files it could not read."""
    dest = _old_save(tmp_path / "shared")
    other = 65534
    os.chown(dest, other, other)
    dest.chmod(0o777)
    (dest / "secret.txt").write_text("theirs")
    os.chown(dest / "secret.txt", other, other)
    (dest / "secret.txt").chmod(0o600)
    before = {p.name: p.stat().st_ino for p in dest.iterdir()}
    with atomic_folder(dest, drop=["model.safetensors", "model-*-of-*.safetensors"]) as tmp:
        assert tmp.parent == dest
        (tmp / "model.safetensors").write_text("new weights")
    assert _tree(dest) == {
        "model.safetensors": b"new weights",
        "notes.txt": b"mine",
        "secret.txt": b"theirs",
    }
    assert dest.stat().st_uid == other and (dest / "secret.txt").stat().st_uid == other
    for name in ("notes.txt", "secret.txt"):  # the same files, not copies
        assert (dest / name).stat().st_ino == before[name]
    assert _temps(dest) == [] and _temps(tmp_path) == []


def test_current_directory_is_written_in_place(tmp_path, monkeypatch):
    """Reviewer: saving into the current directory swapped it away: os.getcwd() then raised
    FileNotFoundError and later relative writes went to the deleted folder."""
    dest = _old_save(tmp_path / "work")
    inode = dest.stat().st_ino
    monkeypatch.chdir(dest)
    with atomic_folder(".", drop=["model.safetensors", "model-*-of-*.safetensors"]) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
        (tmp / "config.json").write_text("{}")
    assert Path(os.getcwd()) == dest and os.stat(".").st_ino == inode
    assert {k: v.decode() for k, v in _tree(dest).items()} == _NEW
    assert _temps(dest) == [] and _temps(tmp_path) == []


def test_in_place_failure_leaves_dest_untouched(tmp_path, monkeypatch):
    dest = _old_save(tmp_path / "work")
    before = _tree(dest)
    monkeypatch.chdir(dest)
    with pytest.raises(RuntimeError, match="boom"), atomic_folder(dest) as tmp:
        assert tmp.parent == dest
        (tmp / "model.safetensors").write_text("half")
        raise RuntimeError("boom")
    assert _tree(dest) == before and _temps(dest) == []


def test_in_place_never_follows_symlinks(tmp_path, monkeypatch):
    dest = _old_save(tmp_path / "work")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("victim")
    (dest / "config.json").symlink_to(outside / "config.json")
    (dest / "1_Pooling").symlink_to(outside)
    monkeypatch.chdir(dest)
    with atomic_folder(dest) as tmp:
        (tmp / "config.json").write_text("{}")
    assert not (dest / "config.json").is_symlink() and (dest / "config.json").read_text() == "{}"
    assert (outside / "config.json").read_text() == "victim"
    with pytest.raises(UnsafePathError, match="symlink"), atomic_folder(dest) as tmp:
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "config.json").write_text("pool")
    assert sorted(p.name for p in outside.iterdir()) == ["config.json"]


# -- an in-folder save that cannot replace everything: refused before any rename (reviewer 2) ---
_AS_OTHER = textwrap.dedent(
    """
    import importlib.util, json, os, sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    dest = Path(sys.argv[2])
    drop = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
    error = None
    try:
        with atomic.atomic_folder(dest, drop=drop) as tmp:
            (tmp / "model.safetensors").write_text("NEW")
            (tmp / "config.json").write_text("NEW")
    except PermissionError as exc:
        error = str(exc)
    tree = {p.name: p.read_text() for p in dest.iterdir() if p.is_file()}
    temps = [p.name for p in dest.iterdir() if ".hf_fp8-tmp-" in p.name]
    print(json.dumps({"error": error, "tree": tree, "temps": temps}))
    """
)
_OTHER = 65534


def _as_other_user(dest: Path) -> dict:
    """Run an in-folder save into ``dest`` as uid 65534 (root drops to it)."""
    import json

    prefix = ["setpriv", f"--reuid={_OTHER}", f"--regid={_OTHER}", "--clear-groups", "--"]
    if os.geteuid() != 0 or not _tool_works([*prefix, "true"]):
        pytest.skip("needs root and setpriv to act as another user")
    atomic_py = REPO / "hf_fp8" / "serialization" / "atomic.py"
    cmd = [*prefix, sys.executable, "-c", _AS_OTHER, str(atomic_py), str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def public_tmp():
    """A folder under /tmp that uid 65534 can reach (pytest's tmp_path is root-only)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _file(path: Path, text: str, uid: int) -> None:
    path.write_text(text)
    os.chown(path, uid, uid)


def test_in_place_save_refuses_before_any_rename_in_a_sticky_folder(public_tmp):
    """Reviewer 2: in a sticky (1777) folder where another user owns config.json, the save
    replaced model.safetensors, then failed on config.json: a mix of old and new files."""
    dest = public_tmp / "sticky"
    dest.mkdir()
    dest.chmod(0o1777)
    _file(dest / "config.json", "OLD", 0)
    _file(dest / "model.safetensors", "OLD", _OTHER)
    got = _as_other_user(dest)
    assert got["error"] and "config.json" in got["error"] and "sticky" in got["error"]
    assert got["tree"] == {"config.json": "OLD", "model.safetensors": "OLD"}
    assert got["temps"] == []


def test_in_place_save_skips_folders_it_cannot_read(public_tmp):
    """Reviewer 2: a 0700 subfolder of another user made the stale-file walk raise after
    config.json and the weights were in place (stale shards and index left behind)."""
    dest = public_tmp / "perm"
    dest.mkdir()
    os.chown(dest, _OTHER, _OTHER)
    for name in ("config.json", "model.safetensors", "model-00001-of-00002.safetensors"):
        _file(dest / name, "OLD", _OTHER)
    _file(dest / "model.safetensors.index.json", "OLD", _OTHER)
    (dest / "private").mkdir(mode=0o700)
    (dest / "private" / "mine.txt").write_text("root's")
    got = _as_other_user(dest)
    assert got == {
        "error": None,
        "tree": {"config.json": "NEW", "model.safetensors": "NEW"},
        "temps": [],
    }
    assert (dest / "private" / "mine.txt").read_text() == "root's"


def test_in_place_save_puts_back_what_it_replaced_on_an_error(tmp_path, monkeypatch):
    """An error between two renames (a full disk, a signal) restores the replaced files and
    removes the new ones: the folder is as it was."""
    dest = _old_save(tmp_path / "work")
    (dest / "config.json").write_text("old config")
    (dest / "model.safetensors.index.json").write_text("old index")
    before = _tree(dest)
    monkeypatch.chdir(dest)  # written in place
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    drop = ["model.safetensors", "model-*-of-*.safetensors"]
    with pytest.raises(OSError, match="No space"), atomic_folder(dest, drop=drop) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
        (tmp / "extra.txt").write_text("new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("new")
        (tmp / "config.json").write_text("{}")
    monkeypatch.setattr(os, "replace", real)
    assert _tree(dest) == before
    assert not (dest / "sub").exists() and _temps(dest) == []


@pytest.mark.parametrize("mode", ["swap", "in-folder"])
def test_drop_patterns_match_only_at_the_top_level(tmp_path, monkeypatch, mode):
    """Reviewer 2: ``model-*-of-*.safetensors`` (fnmatch's ``*`` matches ``/``) deleted a
    user's ``model-v1-backup/model-00001-of-00002.safetensors`` on every overwrite. A pattern
    that names a folder still matches in it."""
    from hf_fp8.hub.hooks import WEIGHT_FILES

    dest = _old_save(tmp_path / "out")
    (dest / "model-v1-backup").mkdir()
    (dest / "model-v1-backup" / "model-00001-of-00002.safetensors").write_text("backup")
    (dest / "model-v1-backup" / "pytorch_model.bin").write_text("backup bin")
    (dest / "old").mkdir()
    (dest / "old" / "stale.bin").write_text("stale")
    monkeypatch.chdir(dest if mode == "in-folder" else tmp_path)
    with atomic_folder(dest, drop=(*WEIGHT_FILES, "old/*.bin")) as tmp:
        assert (tmp.parent == dest) == (mode == "in-folder")
        (tmp / "model.safetensors").write_text("new weights")
        (tmp / "config.json").write_text("{}")
    assert {k: v.decode() for k, v in _tree(dest).items()} == {
        **_NEW,
        "model-v1-backup/model-00001-of-00002.safetensors": "backup",
        "model-v1-backup/pytorch_model.bin": "backup bin",
    }


def test_a_later_save_removes_what_a_killed_save_left(tmp_path, monkeypatch):
    """Reviewer 2: a SIGKILLed in-folder save left dest/.hf_fp8-tmp-* (partial weights)
    forever. A later save removes ours whose process is gone and that nothing wrote to for
    minutes; a folder of a running save (this process), a recent one, and a folder in
    someone else's name scheme are kept."""
    import socket

    dest = _old_save(tmp_path / "work")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    host = socket.gethostname()
    old = time.time() - 3600

    def leftover(name: str, age: float) -> Path:
        folder = dest / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
        os.utime(folder / "model.safetensors", (age, age))
        os.utime(folder, (age, age))
        return folder

    killed = leftover(f"{TMP_MARKER}{host}-{dead_pid}-abc12345", old)
    sibling = tmp_path / f".work{TMP_MARKER}{host}-{dead_pid}-def67890"
    sibling.mkdir()
    os.utime(sibling, (old, old))
    running = leftover(f"{TMP_MARKER}{host}-{os.getpid()}-abc12345", old)
    recent = leftover(f"{TMP_MARKER}{host}-{dead_pid}-recent00", time.time())
    foreign = leftover(f"{TMP_MARKER}abc12345", old)
    restore = leftover(f"{TMP_MARKER}{host}-{dead_pid}-abc00000-restore", old)
    monkeypatch.chdir(dest)  # written in place
    with atomic_folder(dest, drop=["model.safetensors"]) as tmp:
        assert tmp.name.startswith(f"{TMP_MARKER}{host}-{os.getpid()}-")
        (tmp / "model.safetensors").write_text("new weights")
    assert not killed.exists() and not sibling.exists()
    assert running.exists() and recent.exists() and foreign.exists() and restore.exists()
    assert (dest / "model.safetensors").read_text() == "new weights"
