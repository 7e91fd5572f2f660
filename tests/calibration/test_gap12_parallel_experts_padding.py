"""Gap 12.1: JetMoE's parallel experts (``forward(inputs, expert_size)``, rows gathered by the
caller) saw padded rows in calibration: ``calibrate`` masked padding out of every per-token
input and out of ``Fp8Experts`` rows, but observed a parallel experts' rows whole, so a pad
embedding that spikes after the norm set their scales (0.0126 instead of 0.0078 on the model
below). Now each gathered row is traced to its token through the router's ``batch_index``.

Reference: the same model calibrated on the same real tokens without padding (one unpadded
sequence per batch). Rows of two batches shaped differently may round differently in the
last bit, hence ``rel=1e-5``; padding, when counted, changes the scales by ~60 %."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts

HIDDEN = 32
PAD = 0
SPIKE = 30.0  # the pad embedding: one large channel
LENGTHS = [10, 6, 4]  # right padding to 10


def _jetmoe() -> nn.Module:
    torch.manual_seed(0)
    config = tf.JetMoeConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = tf.JetMoeForCausalLM(config).eval()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[PAD].zero_()
        emb[PAD, 5] = SPIKE
    return hf_fp8.quantize_model(model, Fp8Config("static"), skip=["lm_head"])


def _batches() -> tuple[dict, list[dict]]:
    """(one right-padded batch, the same real tokens as unpadded one-sequence batches)."""
    ids = torch.randint(
        1, 128, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(1)
    )
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
        ids[row, n:] = PAD
    unpadded = [{"input_ids": ids[row : row + 1, :n]} for row, n in enumerate(LENGTHS)]
    return {"input_ids": ids, "attention_mask": mask}, unpadded


def _calibrate(model: nn.Module, data) -> tuple[dict[str, float], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales = hf_fp8.calibrate(model, data, progress=False)
    return scales, [str(w.message) for w in caught]


def test_parallel_experts_scales_with_padding_equal_those_without():
    model = _jetmoe()
    parallel = [n for n, m in model.named_modules() if isinstance(m, Fp8ParallelExperts)]
    assert len(parallel) == 8  # MLP and attention experts, input and output, 2 layers
    padded, unpadded = _batches()
    reference, _ = _calibrate(model, unpadded)
    got, messages = _calibrate(model, padded)
    assert not any("could not be traced" in m for m in messages), messages
    assert got.keys() == reference.keys()
    for key, want in reference.items():
        assert got[key] == pytest.approx(want, rel=1e-5), key
    # the pad row after layer 0's norm is sqrt(HIDDEN) on one channel: counted, it would set
    # the scale of every layer-0 input_linear expert it reaches (the test would see it)
    spike = math.sqrt(HIDDEN) / 448
    layer0 = [k for k in reference if k.startswith("model.layers.0.") and "input_linear" in k]
    assert layer0 and all(reference[k] < 0.9 * spike for k in layer0)


class _NoRouter(nn.Module):
    """Calls parallel experts with rows whose tokens nothing next to it names."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, rows, sizes, attention_mask=None):
        return self.experts(rows, sizes)


def test_untraceable_rows_are_observed_whole_with_a_warning():
    torch.manual_seed(0)
    source = JetMoeParallelExperts(4, 16, 24)
    nn.init.normal_(source.weight, std=0.1)
    fp8 = Fp8ParallelExperts.from_experts(source, Fp8Config("static"))
    sizes = torch.tensor([3, 2, 4, 3])
    rows = torch.randn(int(sizes.sum()), 16, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[2, 2:] = 0  # a padded batch of 3 x 4 = 12 tokens, as many as rows
    batch = {"rows": rows, "sizes": sizes, "attention_mask": mask}
    scales, messages = _calibrate(_NoRouter(fp8), batch)
    assert any("could not be traced" in m and "experts" in m for m in messages), messages
    start = 0
    for e, n in enumerate(sizes.tolist()):  # every row counted: nothing was dropped on a guess
        want = float(rows[start : start + n].abs().max()) / 448
        assert scales[f"experts.weight[{e}]"] == pytest.approx(want, rel=1e-6), e
        start += n


def test_unpadded_batches_do_not_warn():
    model = _jetmoe()
    _, unpadded = _batches()
    full = {
        "input_ids": unpadded[0]["input_ids"],
        "attention_mask": torch.ones(1, 10, dtype=torch.long),
    }
    _, messages = _calibrate(model, [full, *unpadded])
    assert not any("could not be traced" in m for m in messages), messages
