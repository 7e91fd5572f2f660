"""A killed process leaves no C compiler running and no stale build output (reviewer R20 F7).

The compilers run in a session of their own (so that a timeout reaches cc1 / as): after a
SIGKILL of Python they kept running under init and wrote ``.<name>-<key>.<pid>.<tid>.so`` into
the cache later; once the library existed, nothing removed such files any more.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hf_fp8.utils import native

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")

SOURCE = "int add(int a, int b) { return a + b; }\n"
REPO = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    """No such process, or a zombie (killed, not yet reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    path = tmp_path / "cache"
    monkeypatch.setenv(native.CACHE_ENV, str(path))
    native.forget()
    yield path
    native.forget()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("setpriv") is None,
    reason="the parent-death signal needs Linux and util-linux's setpriv",
)
def test_a_killed_process_leaves_no_compiler_running(cache, tmp_path) -> None:
    """SIGKILL of a Python process while its compiler runs: the compiler driver and its child
    (cc1's stand-in: a sleep) are gone within seconds, and no build output lands later."""
    pids = tmp_path / "pids"
    real = native.compiler()
    fake = tmp_path / "slow-cc"
    fake.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *--version*) exec {real} "$@";; esac\n'
        f"echo $$ > {pids}.tmp; sleep 4 & echo $! >> {pids}.tmp; mv {pids}.tmp {pids}\n"
        "wait\n"
        f'exec {real} "$@"\n'
    )
    fake.chmod(0o755)
    src = tmp_path / "slow.c"
    src.write_text(SOURCE)
    code = textwrap.dedent(
        f"""
        from hf_fp8.utils import native
        native.load_library("slow", {str(src)!r})
        """
    )
    env = {**os.environ, "CC": str(fake), native.CACHE_ENV: str(cache)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not pids.exists():
            assert child.poll() is None, "the build process ended before compiling"
            assert time.monotonic() < deadline, "the compiler never started"
            time.sleep(0.05)
        compiler_pids = [int(x) for x in pids.read_text().split()]
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed = time.monotonic()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    while not all(_gone(pid) for pid in compiler_pids):
        if time.monotonic() - killed > 3:
            for pid in compiler_pids:  # leave nothing running behind the test
                if not _gone(pid):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail("the compiler outlived the killed process")
        time.sleep(0.05)
    time.sleep(max(0.0, killed + 5 - time.monotonic()))  # past the fake compiler's 4 s
    assert sorted(p.name for p in cache.iterdir() if p.suffix == ".so") == []


def test_stale_outputs_are_removed_when_the_library_exists(cache, tmp_path) -> None:
    """A killed build's output that landed after the library was built (an orphaned compiler
    finished late) is removed by the next load; a running process's file is kept."""
    src = tmp_path / "add.c"
    src.write_text(SOURCE)
    native.load_library("stale", src)
    [lib] = cache.glob("*.so")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [cache / f".{lib.stem}.{dead.pid}.7.{s}" for s in ("so", "c", "part0.o")]
    running = cache / f".{lib.stem}.{os.getpid()}.7.so"
    for p in (*stale, running):
        p.write_text("x")
    built = lib.stat().st_mtime_ns
    native.forget()
    lib2 = native.load_library("stale", src)
    lib2.add.restype = None
    assert lib.stat().st_mtime_ns == built  # loaded from the cache, not rebuilt
    assert not any(p.exists() for p in stale)
    assert running.exists()
