"""Gap 13: transformers' Trainer with FSDP2 and ``state_dict_type: FULL_STATE_DICT`` on two gloo
ranks, optimizer ``AdamWFp8`` (fp8 moments): its checkpoints hold the full ``optimizer.bin``
(the fp8 moments gathered as bytes; before, the save was refused) and
``train(resume_from_checkpoint=...)`` ends with the uninterrupted run's weights, bit for bit.

One launch of two ranks (this file run as a script) serves the tests of the module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GLOO_EXIT_ABORT = "terminate called without an active exception"
STEPS, SAVE_EVERY = 4, 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(300 + i))
        return {"input_ids": ids, "labels": ids}


def _train(out: Path, resume: str | None):
    from accelerate import PartialState
    from accelerate.utils import DistributedType
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    import hf_fp8
    from hf_fp8.utils.tiny import tiny_llama_config

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        per_device_train_batch_size=1,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "state_dict_type": "FULL_STATE_DICT",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
        },
    )
    _ = args.device  # sets up the process group (gloo)
    # FSDP needs a GPU distributed type in accelerate; the CPU ranks pose as one (as the
    # other two-rank accelerate tests do)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(64, 2, 32))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_Batches(),
        optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, {"lr": 1e-2, "weight_decay": 0.01}),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, trainer.accelerator.get_state_dict(trainer.model)


def _worker(rank: int, port: int, out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    result: dict = {}
    try:
        trainer, uninterrupted = _train(out / "run", None)
        result["fsdp2"] = trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2
        _, resumed = _train(out / "resumed", str(out / "run" / f"checkpoint-{SAVE_EVERY}"))
        if rank == 0:
            torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, out / "params.pt")
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:1500] + "\n" + traceback.format_exc()[-2500:]
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13: a gloo thread can hang or abort in interpreter teardown


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gap13_trainer")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=500) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, logs, strict=True):
        assert p.returncode == 0 or GLOO_EXIT_ABORT in stderr, f"{stdout[-2000:]}\n{stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], out


def test_trainer_full_state_dict_checkpoint_holds_the_fp8_moments(ranks):
    results, out = ranks
    for result in results:
        assert "error" not in result, result["error"]
        assert result["fsdp2"]  # the run really was FSDP2, not DDP
    saved = torch.load(
        out / "run" / f"checkpoint-{SAVE_EVERY}" / "optimizer.bin", weights_only=True
    )
    codes = [v for st in saved["state"].values() for v in st.values() if v.dtype.itemsize == 1]
    assert codes and all(v.dtype == torch.float8_e4m3fn for v in codes)
    assert "model.embed_tokens.weight" in saved["state"]  # parameters by name, whole
    assert saved["state"]["model.embed_tokens.weight"]["exp_avg_fp8"].shape == (256, 128)


def test_trainer_resume_from_full_state_dict_checkpoint_is_bit_exact(ranks):
    results, out = ranks
    for result in results:
        assert "error" not in result, result["error"]
    params = torch.load(out / "params.pt", weights_only=True)
    want, got = params["uninterrupted"], params["resumed"]
    assert set(got) == set(want)
    for key, ref in want.items():
        assert torch.equal(got[key], ref), key


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
