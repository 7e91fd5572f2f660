"""FSDP2 worker for test_fsdp2.py: run as ``python fsdp_worker.py RANK WORLD PORT OUTDIR``.

Each rank shards a small model with ``fully_shard`` (gloo, CPU), trains a few steps with
AdamWFp8 on the same batch as a single-process run, saves / loads the optimizer through
``torch.distributed.checkpoint`` and writes the full parameters of every phase to OUTDIR.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from hf_fp8.optim import AdamWFp8

STEPS_BEFORE, STEPS_AFTER = 3, 2
# stochastic rounding on: the ranks must draw the bits of their rows in the full tensor
_BASE = {"lr": 1e-2, "weight_decay": 0.01, "min_quantize_numel": 1024}
# Optimizer options per test variant: the "log" moment format (stochastic rounding of both)
# and the default fp8 codes with every stream option on.
OPTIM_VARIANTS = {
    "log": {**_BASE, "stochastic_rounding": True, "moment_format": "log"},
    "fp8": {**_BASE, "stochastic_rounding": True, "sqrt_second_moment": True},
}


def build_model() -> nn.Module:
    """Linear layers with an odd row count (uneven shards), biases (fp32 states), a 1-D norm."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 257),
        nn.GELU(),
        nn.Linear(257, 128, bias=False),
        nn.LayerNorm(128),
        nn.Linear(128, 40),
    )


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 + step))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        loss = model(batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def sharded(mesh_world: int, variant: str = "fp8") -> tuple[nn.Module, AdamWFp8]:
    model = build_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model, AdamWFp8(model.parameters(), **OPTIM_VARIANTS[variant])


def main(rank: int, world: int, port: int, outdir: str, variant: str = "fp8") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        model, opt = sharded(world, variant)
        train_steps(model, opt, range(STEPS_BEFORE))
        phase1 = full_params(model)
        ckpt = os.path.join(outdir, "dcp")
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
        model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train_steps(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        uninterrupted = full_params(model)

        model2, opt2 = sharded(world, variant)
        model2.load_state_dict(model_state)
        state = {"optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(state, checkpoint_id=ckpt)
        set_optimizer_state_dict(model2, opt2, state["optim"])
        train_steps(model2, opt2, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        resumed = full_params(model2)
        kinds = sorted({type(v).__name__ for st in opt.state.values() for v in st.values()})
        if rank == 0:
            torch.save(
                {
                    "phase1": phase1,
                    "uninterrupted": uninterrupted,
                    "resumed": resumed,
                    "kinds": kinds,
                },
                os.path.join(outdir, "result.pt"),
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    # skip interpreter finalization: there, a gloo run-loop thread of torch that touches
    # Python is ended by pthread_exit through noexcept C++ frames ("terminate called without
    # an active exception", about 1 run in 15 on 2 busy cores; a torch/gloo shutdown race)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
