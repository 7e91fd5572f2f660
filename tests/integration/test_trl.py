"""integrations/trl/sft.py: SFTTrainer, FP8 base + LoRA + adamw_fp8_coat vs fp32 AdamW."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8

pytest.importorskip("trl")
pytest.importorskip("datasets")

SCRIPT = Path(__file__).resolve().parents[2] / "integrations" / "trl" / "sft.py"
# min_quantize_numel=0: the tiny adapters get FP8 moments too (real ones are large enough)
TINY = ["--steps", "8", "--batch", "4", "--hidden", "64", "--max-length", "32"]
TINY += ["--eval-examples", "16", "--min-quantize-numel", "0", "--rank", "16"]


def _script():
    spec = importlib.util.spec_from_file_location("integrations_trl_sft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: more threads only add contention on a busy machine
    try:
        sft = _script()
        return {o: sft.main([*TINY, "--optim", o]) for o in ("adamw_fp8_coat", "adamw_torch")}
    finally:
        torch.set_num_threads(threads)


def _lora(run: dict, kind: str) -> dict[str, torch.Tensor]:
    model = run["trainer"].model
    return {n: p.detach().float() for n, p in model.named_parameters() if kind in n}


@pytest.mark.slow
def test_sft_trains_lora_on_frozen_fp8_base_with_fp8_states(runs):
    coat = runs["adamw_fp8_coat"]
    assert coat["optimizer"] == "AdamWFp8" and coat["fp8_state_tensors"] > 0
    assert runs["adamw_torch"]["optimizer"] == "AdamW"
    assert coat["fp8_layers"] == 2 * 7  # every projection of both decoder layers
    assert coat["eval_after"] < coat["eval_before"] - 0.05
    model = coat["trainer"].model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # the FP8 base is untouched: the same bytes as a fresh FP8 load of the same checkpoint
    fresh = AutoModelForCausalLM.from_pretrained(
        coat["base"], dtype=torch.bfloat16, quantization_config=hf_fp8.Fp8Config("dynamic")
    )
    trained = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): m
        for n, m in model.named_modules()
    }
    for name, layer in fresh.named_modules():
        if isinstance(layer, hf_fp8.Fp8Linear):
            weight = trained[name].weight
            assert weight.dtype == torch.float8_e4m3fn and not weight.requires_grad
            assert torch.equal(weight.view(torch.uint8), layer.weight.view(torch.uint8)), name


@pytest.mark.slow
def test_sft_with_fp8_states_tracks_fp32_adamw(runs):
    coat, ref = runs["adamw_fp8_coat"], runs["adamw_torch"]
    assert coat["state_bytes"] < 0.4 * ref["state_bytes"]  # group_size=rank: 3 bytes / param
    # lora_B starts at zero, so it is the whole update; FP8 moments stay within a few %
    ours, theirs = _lora(coat, "lora_B"), _lora(ref, "lora_B")
    diff = sum((ours[n] - theirs[n]).square().sum() for n in theirs).sqrt()
    assert diff / sum(t.square().sum() for t in theirs.values()).sqrt() < 0.05
    gain_ours = coat["eval_before"] - coat["eval_after"]
    gain_theirs = ref["eval_before"] - ref["eval_after"]
    assert coat["eval_before"] == ref["eval_before"]
    assert abs(gain_ours - gain_theirs) < 0.1 * gain_theirs


def test_fp8_states_of_lora_adapters_are_never_larger_than_fp32():
    rank, width = 16, 4096
    lora_a = torch.nn.Parameter(torch.randn(rank, width) * 0.01)  # [r, in]
    lora_b = torch.nn.Parameter(torch.randn(width, rank) * 0.01)  # [out, r]
    for p in (lora_a, lora_b):
        p.grad = torch.randn_like(p)
    optimizer = hf_fp8.AdamWFp8([lora_a, lora_b], lr=1e-3)
    optimizer.step()
    for p in (lora_a, lora_b):
        state = optimizer.state[p]
        nbytes = sum(v.nbytes for k, v in state.items() if k != "step")
        assert nbytes <= 8 * p.numel(), (tuple(p.shape), nbytes / p.numel())
