"""FSDP2 (``fully_shard``, 2 gloo CPU ranks) on a tiny FP8 MoE model, against the same
training in one process (issue 11 §3). The FP8 expert codes and scales are ordinary frozen
parameters to FSDP2: they shard on the expert dimension (5 experts: 3 + 2 rows), gather for
the forward and come out of training bit-identical; the high-precision parts train with
``AdamWFp8`` (with and without COAT) exactly as in one process. With the experts kept in high
precision, ``AdamWFp8`` trains the sharded 3-D expert parameters with FP8 moments."""

from __future__ import annotations

import pytest
import torch

from tests.bitwise import assert_bit_equal
from tests.integration import moe_fsdp_worker as worker
from tests.ranks import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("moe_fsdp2")
    run_ranks(worker.__file__, out, world=2, timeout=240)
    return torch.load(out / "result.pt", weights_only=True)


@pytest.fixture(scope="module")
def single_runs() -> dict[str, dict]:
    """The reference: every variant trained in this process, one thread like the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for variant in worker.VARIANTS:
            model = worker.build_model(variant)
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt = worker.make_optimizer(model, variant)
            losses = worker.train_steps(model, opt)
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            out[variant] = {"losses": losses, "params": params, "start": start, "frozen": frozen}
        return out
    finally:
        torch.set_num_threads(threads)


EXACT = [v for v in worker.VARIANTS if v != "fp8_bf16"]
ONE_BYTE = ("float8_e4m3fn", "float8_e5m2", "int8", "uint8")


def _one_byte_dtensor_states(states: list[str]) -> list[str]:
    """The ``"DTensor:torch.<dtype>"`` optimizer states stored in one byte per element."""
    return [s for s in states if s.startswith("DTensor:") and s.endswith(ONE_BYTE)]


@pytest.mark.parametrize("variant", EXACT)
def test_two_ranks_train_like_one_process(sharded_runs, single_runs, variant: str) -> None:
    fsdp, single = sharded_runs[variant], single_runs[variant]
    assert single["losses"][-1] < single["losses"][0], single["losses"]  # it trains
    # same batch on both ranks and one thread each: the averaged gradients are the
    # single-process ones bit for bit, and AdamWFp8's groups follow rows (never straddle a
    # shard), so every loss and every parameter, trained or frozen, is identical
    assert fsdp["losses"] == single["losses"]
    assert fsdp["params"].keys() == single["params"].keys()
    for name, want in single["params"].items():
        assert_bit_equal(fsdp["params"][name], want, name)
    assert _one_byte_dtensor_states(fsdp["states"])  # sharded 8-bit moments


@pytest.mark.parametrize("variant", ["fp8_coat", "fp8_plain", "fp8_split", "fp8_bf16"])
def test_fp8_expert_codes_and_scales_shard_and_stay_frozen(
    sharded_runs, single_runs, variant: str
) -> None:
    fsdp, single = sharded_runs[variant], single_runs[variant]
    shards = fsdp["shards"]
    assert set(shards) == {
        "gate_up_proj",
        "gate_up_proj_weight_scale",
        "down_proj",
        "down_proj_weight_scale",
    }
    for name, shard in shards.items():
        assert shard["placements"] == ["S(0)"], (name, shard)  # split on the expert dim
        assert shard["local_shape"][0] == 3, (name, shard)  # rank 0 holds experts 0-2 of 5
    assert shards["gate_up_proj"]["dtype"] == "torch.float8_e4m3fn"
    assert shards["down_proj_weight_scale"]["dtype"] == "torch.float32"
    experts = [n for n in single["frozen"] if ".experts." in n]
    assert len(experts) == 4 * worker.build_model(variant).config.num_hidden_layers
    for name in experts:  # after the steps: the codes and scales the model started with
        assert_bit_equal(fsdp["params"][name], single["start"][name], name)
        if name.endswith("_proj"):
            assert fsdp["params"][name].dtype == torch.float8_e4m3fn


def test_high_precision_experts_train_sharded_with_fp8_moments(sharded_runs, single_runs) -> None:
    fsdp, single = sharded_runs["hp_experts"], single_runs["hp_experts"]
    assert fsdp["shards"]["gate_up_proj"] == {
        "placements": ["S(0)"],
        "local_shape": (3, 128, 64),
        "dtype": "torch.float32",
    }
    name = "model.layers.0.mlp.experts.gate_up_proj"
    moved = fsdp["params"][name] - single["start"][name]
    assert float(moved.abs().max()) > 1e-4  # the 3-D experts trained (and equal one process)
    assert_bit_equal(fsdp["params"][name], single["params"][name], name)


def test_bf16_mixed_precision_keeps_fp8_codes_with_fully_shard_fp8(
    sharded_runs, single_runs
) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16) on the layers: with ``fully_shard_fp8`` the
    codes stay fp8 (checked above) and training follows the fp32 run to bf16 precision;
    without it FSDP2 casts the codes to bf16 and the FP8 layers refuse them, naming the fix."""
    bf16, fp32 = sharded_runs["fp8_bf16"], single_runs["fp8_bf16"]
    assert bf16["losses"][-1] < bf16["losses"][0]
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=2e-2)
    diff = moved = 0.0
    for name, want in fp32["params"].items():
        if name not in fp32["frozen"]:
            got, start = bf16["params"][name], fp32["start"][name]
            assert got.dtype == want.dtype == torch.float32, name  # sharded params stay fp32
            diff += float((got - want).pow(2).sum())
            moved += float((want - start).pow(2).sum())
    # Adam's normalised steps from bf16 gradients: near-zero gradients flip some signs
    assert (diff / moved) ** 0.5 < 0.2, (diff / moved) ** 0.5
    error = sharded_runs["no_helper_error"]
    assert error is not None and "bfloat16" in error, error
    assert "fully_shard_fp8" in error, error
