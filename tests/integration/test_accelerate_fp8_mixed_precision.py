"""accelerate + FSDP2 + ``mixed_precision="bf16"`` on FP8 models, script unchanged (2 gloo CPU
ranks, ``tests/integration/accelerate_fp8_worker.py``), against the same training in one
process without accelerate or FSDP (fp32).

Without the ``accelerate_fsdp2`` patch FSDP2 casts the fp8 codes to bf16 at every
all-gather: the LoRA Llama's ``Fp8Linear`` layers then compute from bf16 copies (silently,
twice the bytes gathered) and the MoE's ``Fp8Experts`` refuses them
(``ValueError: expert weights are torch.bfloat16``). With it every FP8 module is its own
FSDP2 group that keeps the stored dtypes, and training follows the fp32 run to bf16 precision.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration import accelerate_fp8_worker as worker
from tests.ranks import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]

RUNS = {  # result name -> worker arguments
    "llama_lora": ["llama_lora"],
    "moe_norms": ["moe_norms"],
    "llama_lora_manual": ["llama_lora", "--manual"],
}
FP8 = "torch.float8_e4m3fn"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("accelerate_fp8")
    for args in RUNS.values():
        run_ranks(worker.__file__, out, world=2, timeout=240, args=args)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in RUNS}


@pytest.fixture(scope="module")
def single() -> dict[str, dict]:
    """The reference: each variant in this process, fp32, no accelerate, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {v: worker.run(v, single=True) for v in ("llama_lora", "moe_norms")}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(RUNS))
def test_fp8_codes_stay_fp8_through_prepare_forward_and_steps(sharded, name: str) -> None:
    run = sharded[name]
    assert run["distributed_type"] == "DistributedType.FSDP"
    assert run["error"] is None, run["error"]
    assert run["prepared"] and set(run["prepared"].values()) == {FP8}, run["prepared"]
    assert run["forward_dtypes"] == [FP8]  # what FSDP2 all-gathered for each forward
    assert set(run["trained"].values()) == {FP8}, run["trained"]
    assert len(run["losses"]) == worker.STEPS


@pytest.mark.parametrize("name", list(RUNS))
def test_training_follows_the_fp32_run_without_fsdp(sharded, single, name: str) -> None:
    run = sharded[name]
    ref = single[name.removesuffix("_manual")]
    assert ref["forward_dtypes"] == [FP8] and ref["error"] is None
    # bf16 compute (and bf16 logits: the loss itself is rounded to bf16) vs fp32
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-2)
    assert run["params"].keys() == ref["params"].keys() == ref["start"].keys()
    diff = moved = moved_here = 0.0
    for param, want in ref["params"].items():
        got, start = run["params"][param], ref["start"][param]
        assert torch.equal(run["start"][param], start), param  # same initial weights
        diff += float((got - want).pow(2).sum())
        moved += float((want - start).pow(2).sum())
        moved_here += float((got - start).pow(2).sum())
    assert moved > 0.1 and moved_here > 0.5 * moved, (moved, moved_here)  # they train
    # Adam's normalised steps from bf16 gradients: measured 0.10 (LoRA), 0.12 (norms)
    assert (diff / moved) ** 0.5 < 0.25, (diff / moved) ** 0.5
