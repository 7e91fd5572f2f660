"""FSDP2 (``fully_shard``, 2 gloo ranks on loopback) against a single-process run, and a
save / load of the optimizer through ``torch.distributed.checkpoint``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from tests.optim import fsdp_worker as worker

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without distributed"
)
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(worker.OPTIM_VARIANTS))
def test_fsdp2_two_ranks_match_single_process_and_dcp_resume(tmp_path, variant):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(worker.__file__)),
                str(rank),
                "2",
                str(port),
                str(tmp_path),
                variant,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert "DTensor" in result["kinds"]  # the sharded states are DTensors

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: matmul reduction order depends on the thread count
    try:
        model = worker.build_model()
        opt = AdamWFp8(model.parameters(), **worker.OPTIM_VARIANTS[variant])
        worker.train_steps(model, opt, range(worker.STEPS_BEFORE))
        single = {k: v.detach().clone() for k, v in model.named_parameters()}
        end = worker.STEPS_BEFORE + worker.STEPS_AFTER
        worker.train_steps(model, opt, range(worker.STEPS_BEFORE, end))
        single_end = {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)
    assert any("exp_avg_fp8" in st for st in opt.state.values())
    quantized = [st for st in opt.state.values() if "exp_avg_sq_fp8" in st]
    want = torch.uint8 if variant == "log" else torch.float8_e4m3fn  # the format under test
    assert quantized and all(st["exp_avg_sq_fp8"].dtype == want for st in quantized)
    for name in single:
        # same batch on both ranks: averaged gradients equal the single-process ones exactly,
        # and groups never straddle a shard boundary (they follow rows)
        assert torch.equal(result["phase1"][name], single[name]), name
        assert torch.equal(result["uninterrupted"][name], single_end[name]), name
        assert torch.equal(result["resumed"][name], result["uninterrupted"][name]), name
