"""R41 finding 9: a FULL_STATE_DICT optimizer.bin write killed before its rename (SIGKILL:
OOM killer, preemption) left its hidden ``.optimizer.bin.hf_fp8-partial-…`` file forever.
The next save removes the partial files of dead processes by hf_fp8's orphan rules (its own
name pattern, this user's regular files, a process of this host that is gone) and keeps
every other file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

KILLED_WRITE = """
import os, signal, sys, torch
from hf_fp8.patches.accelerate_fsdp2 import _save_whole
real = torch.save
def dying(obj, f, *a, **k):
    real(obj, f, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # after the bytes, before fsync and rename
torch.save = dying
_save_whole({"new": torch.arange(1000.0)}, sys.argv[1])
"""


def _killed_write(target: Path) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITE, str(target)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    return proc.returncode


def test_next_save_removes_the_partial_files_of_killed_writes(tmp_path):
    from hf_fp8.patches.accelerate_fsdp2 import _save_whole

    target = tmp_path / "optimizer.bin"
    torch.save({"old": torch.zeros(3)}, target)
    _killed_write(target)
    first = [p.name for p in tmp_path.iterdir() if p.name != "optimizer.bin"]
    assert len(first) == 1 and first[0].startswith(".optimizer.bin.hf_fp8-partial-"), first
    _killed_write(target)  # the next (killed) save removed the first one's, left its own
    second = [p.name for p in tmp_path.iterdir() if p.name != "optimizer.bin"]
    assert len(second) == 1 and second != first, (first, second)
    assert torch.equal(torch.load(target, weights_only=True)["old"], torch.zeros(3))
    # files the rules keep: another host's, a living process's (this one), a link, other names
    host, me = socket.gethostname(), os.getpid()
    kept = [
        f".optimizer.bin.hf_fp8-partial-other-{host}x-{2**22 + 7}",
        f".optimizer.bin.hf_fp8-partial-{host}-{me}9",  # not this process: see below
        "notes.txt",
        ".optimizer.bin.hf_fp8-partial-mine",
    ]
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        kept[1] = f".optimizer.bin.hf_fp8-partial-{host}-{alive.pid}"
        for name in kept:
            (tmp_path / name).write_bytes(b"x")
        (tmp_path / f".optimizer.bin.hf_fp8-partial-{host}-{2**22 + 9}").symlink_to(
            tmp_path / "notes.txt"
        )
        kept.append(f".optimizer.bin.hf_fp8-partial-{host}-{2**22 + 9}")
        _save_whole({"new": torch.arange(1000.0)}, str(target))  # the next save
        left = sorted(p.name for p in tmp_path.iterdir())
    finally:
        alive.kill()
        alive.wait()
    assert left == sorted(["optimizer.bin", *kept]), left
    # the reference: what an uninterrupted save writes
    assert torch.equal(torch.load(target, weights_only=True)["new"], torch.arange(1000.0))
