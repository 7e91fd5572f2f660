"""R39 F2: ``from_pretrained(..., tp_plan="auto")`` of an FP8 model (pre-quantized row-wise or
tensor-wise, or on the fly) is refused on every rank, before any rank loads a weight, with one
error naming the alternatives; before, the ranks died on DTensor / shape errors (the scales
are not sharded with their weights) or one rank hung.

This file is also the worker: ``python test_review39_tp_plan.py RANK WORLD PORT OUTDIR``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CASES = ("row", "tensor", "otf")


def _folders(root: Path) -> dict[str, tuple[str, dict]]:
    return {
        "row": (str(root / "fp8_row"), {}),
        "tensor": (str(root / "fp8_tensor"), {}),
        "otf": (str(root / "float"), {"dynamic": True}),
    }


def worker(rank: int, world: int, port: int, outdir: Path) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    from transformers import AutoModelForCausalLM

    import hf_fp8

    torch.set_num_threads(1)
    results = {}
    for case, (folder, otf) in _folders(outdir).items():
        kwargs = {"quantization_config": hf_fp8.Fp8Config("dynamic")} if otf else {}
        try:
            AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", **kwargs)
            results[case] = ["loaded", ""]
        except Exception as err:
            results[case] = [type(err).__name__, str(err)]
    (outdir / f"rank{rank}.json").write_text(json.dumps(results))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # torch 2.13 gloo teardown (tests/ranks.py)


if __name__ == "__main__":
    rank, world, port, out = sys.argv[1:5]
    worker(int(rank), int(world), int(port), Path(out))


def test_tp_plan_is_refused_on_every_rank(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fp8 import Fp8Config
    from tests.ranks import run_ranks

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    folders = _folders(tmp_path)
    LlamaForCausalLM(config).save_pretrained(folders["otf"][0])
    for case, granularity in (("row", "row"), ("tensor", "tensor")):
        model = LlamaForCausalLM.from_pretrained(
            folders["otf"][0],
            quantization_config=Fp8Config("dynamic", weight_granularity=granularity),
        )
        model.save_pretrained(folders[case][0])
    run_ranks(Path(__file__), tmp_path, world=2, timeout=150)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(CASES)
        for case, (kind, message) in results.items():
            assert kind == "ValueError", (rank, case, kind, message)
            assert "tensor parallel" in message, (rank, case, message)
            assert "device_map" in message and "FSDP2" in message, (rank, case, message)
