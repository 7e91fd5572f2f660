"""Importing a third-party static MoE checkpoint (one linear per expert) whose gate and up input
scales differ, even by 1 %, was refused with weight-scale advice ("re-quantize with per-row or
block weight scales"), which means nothing for input scales (reviewer R27, minor). gate and up
read the same input, so the merged projection keeps their largest scale, as vLLM does
(``w13_input_scale.max()``): no calibrated amax saturates."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_fp8
from hf_fp8 import Fp8Config
from tests.serialization.moe_fixtures import tiny_qwen3_moe

EXPERT = "model.layers.0.mlp.experts.3"


def test_import_keeps_the_largest_of_gate_and_up_input_scales(tmp_path):
    config = Fp8Config("static", activation_scale=0.05, weight_granularity="tensor")
    model = hf_fp8.quantize_model(tiny_qwen3_moe(), config, skip=["lm_head"])
    model.save_pretrained(tmp_path / "hf")
    hf_fp8.export(tmp_path / "hf", tmp_path / "ct", "compressed-tensors")
    path = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(path)
    up = f"{EXPERT}.up_proj.input_scale"
    gate = f"{EXPERT}.gate_proj.input_scale"
    assert up in tensors and gate in tensors
    tensors[up] = tensors[up] * 1.01
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="largest"):
        hf_fp8.import_checkpoint(tmp_path / "ct", tmp_path / "imp")
    merged = load_file(tmp_path / "imp" / "model.safetensors")[
        "model.layers.0.mlp.experts.gate_up_proj_input_scale"
    ]
    assert float(merged[3]) == max(float(tensors[up]), float(tensors[gate]))
    others = [e for e in range(merged.numel()) if e != 3]
    assert torch.equal(merged[others], torch.full((len(others),), 0.05))
