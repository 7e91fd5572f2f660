"""integrations/accelerate: AdamWFp8 under FSDP2 (2 CPU ranks over gloo) vs one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "integrations" / "accelerate" / "train_fsdp2.py"
CONFIG = ROOT / "integrations" / "accelerate" / "fsdp2.yaml"
TINY = ["--hidden", "64", "--layers", "2", "--seq-len", "64", "--global-batch", "4"]
STEPS = 6
GLOO_EXIT_ABORT = "terminate called without an active exception"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], report: Path) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and GLOO_EXIT_ABORT in proc.stderr:
        # torch 2.13's gloo run-loop thread ended by Python's finalization (README, "Known at
        # exit"): about 1 two-rank run in 15 aborts after its work is done. Run it once more;
        # a second failure fails the test.
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(report.read_text())
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result


def _launch(nproc: int, tmp: Path, name: str, *args: str) -> dict:
    report = tmp / f"{name}.json"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG)]
    launcher += ["--num_processes", str(nproc), "--main_process_port", str(_free_port())]
    return _run([*launcher, str(SCRIPT), *TINY, "--report", str(report), *args], report)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    out = ["--output-dir", str(tmp / "ckpt"), "--steps", str(STEPS)]
    fsdp = _launch(2, tmp, "fsdp", *out, "--save-every", "3")
    report = tmp / "single.json"
    single = _run(
        [sys.executable, str(SCRIPT), *TINY, "--steps", str(STEPS), "--report", str(report)],
        report,
    )
    resumed = _launch(2, tmp, "resumed", *out, "--resume-from", str(tmp / "ckpt" / "step_3"))
    return {"fsdp": fsdp, "single": single, "resumed": resumed, "ckpt": tmp / "ckpt" / "step_3"}


def test_two_ranks_shard_with_fsdp2_and_train(runs):
    fsdp = runs["fsdp"]
    assert fsdp["distributed_type"] == "DistributedType.FSDP" and fsdp["world_size"] == 2
    assert runs["single"]["distributed_type"] == "DistributedType.NO"
    losses = fsdp["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.2, losses
    assert fsdp["optimizer_state"]["fp8_tensors"] > 0


def test_two_rank_loss_curve_matches_single_process(runs):
    fsdp, single = runs["fsdp"]["losses"], runs["single"]["losses"]
    for step in range(1, 6):
        assert abs(fsdp[step] - single[step]) / abs(single[step]) < 1e-3, (step, fsdp, single)
    assert (
        abs(runs["fsdp"]["eval_loss"] - runs["single"]["eval_loss"])
        < 1e-3 * runs["single"]["eval_loss"]
    )
    # sharded states add up to the unsharded ones
    assert runs["fsdp"]["optimizer_state"]["bytes"] == runs["single"]["optimizer_state"]["bytes"]


def test_sharded_checkpoint_holds_fp8_moments_and_resumes_exactly(runs):
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(runs["ckpt"] / "optimizer_0")).read_metadata()
    dtypes = {
        key: meta.properties.dtype
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "properties")
    }
    fp8_keys = [k for k in dtypes if k.endswith(("exp_avg_fp8", "exp_avg_sq_fp8"))]
    assert fp8_keys and all(dtypes[k] == torch.float8_e4m3fn for k in fp8_keys)
    resumed, original = runs["resumed"]["losses"], runs["fsdp"]["losses"]
    assert sorted(resumed) == list(range(4, STEPS + 1))
    for step, loss in resumed.items():  # steps 5-6 depend on the reloaded FP8 moments
        assert loss == pytest.approx(original[step], rel=1e-6, abs=0), (step, resumed, original)
