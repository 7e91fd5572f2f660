"""R25 F7 under FSDP2: ``out += residual`` right after an Fp8Linear that
``hf_fp8.fully_shard_fp8`` made its own FSDP2 module. With a view output torch warns that the
in-place op "will silently drop the pre-backward hook"; the gradients of two gloo ranks must
match a single-process run (fp32 reference: the same model, unsharded) and no such warning
may appear. Run as ``python THIS_FILE RANK WORLD PORT OUTDIR`` by ``tests/ranks.py``."""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from hf_fp8 import Fp8Config
        from hf_fp8.modules import Fp8Linear

        torch.manual_seed(0)
        self.up = Fp8Linear.from_linear(nn.Linear(64, 48), Fp8Config("dynamic"))
        self.norm = nn.LayerNorm(48)
        self.head = nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h += x[..., :48]  # in place on the FSDP2 module's output
        return self.head(self.norm(h)).sum(-1)  # not a view: nn.Linear's 3-D output is one


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    model(x).pow(2).sum().backward()
    out = {"x": x.grad.detach().clone()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
    return out


def _batch() -> torch.Tensor:
    return torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7))


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hf_fp8 import fully_shard_fp8

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        model = _Model()
        fully_shard_fp8(model)
        fully_shard(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads = _grads(model, _batch())
        views = [str(w.message) for w in caught if "view" in str(w.message)]
        if rank == 0:
            torch.save({"grads": grads, "views": views}, Path(outdir) / "rank0.pt")
    finally:
        dist.destroy_process_group()


def test_in_place_after_a_sharded_fp8_linear(tmp_path):
    from tests.ranks import run_ranks

    run_ranks(Path(__file__), tmp_path, world=2, timeout=240)
    got = torch.load(tmp_path / "rank0.pt")
    assert got["views"] == []
    want = _grads(_Model(), _batch())
    assert set(got["grads"]) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got["grads"][name], value, rtol=1e-5, atol=1e-6, msg=name)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # skip interpreter finalization, where torch 2.13's gloo run-loop thread aborts or hangs
    # (README "Known at exit"), as the other two-rank workers do
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
