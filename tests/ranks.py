"""Run a worker script as N ``torch.distributed`` ranks (gloo on loopback), each its own
process, with a timeout: every rank that outlives it is killed and its output is shown.

A worker is ``python SCRIPT RANK WORLD PORT OUTDIR [ARGS...]`` (see
``tests/optim/fsdp_worker.py``, ``tests/integration/moe_fsdp_worker.py``); it initialises the
process group itself, and destroys it in a ``finally``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port nothing listens on right now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: str | Path,
    outdir: Path,
    *,
    world: int = 2,
    timeout: float = 240,
    args: Sequence[str] = (),
) -> list[str]:
    """Run ``script`` as ``world`` ranks writing to ``outdir`` (``args`` after it); assert
    every rank exits 0 within ``timeout`` seconds (the message holds the tail of each rank's
    output). One thread per rank (``OMP_NUM_THREADS=1``), as a single-process reference
    should use."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), str(port), str(outdir), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0] + f"\n[killed after {timeout} s]")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    report = "\n".join(
        f"--- rank {r} (exit {p.returncode})\n{o[-3000:]}"
        for r, (p, o) in enumerate(zip(procs, outputs, strict=True))
    )
    assert all(p.returncode == 0 for p in procs), report
    return outputs
