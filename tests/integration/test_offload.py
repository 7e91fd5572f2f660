"""Offloading a pre-quantized hf_fp8 checkpoint: device_map with "disk", "auto" + max_memory,
accelerate's ``disk_offload`` and (on a GPU) CPU offload through accelerate's hooks."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import disk_offload
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Linear
from tests.tiny_models import LLAMA_LAYER_1_ON_DISK, model_inputs

LAYER_1_ON_DISK = dict(LLAMA_LAYER_1_ON_DISK)


@pytest.fixture(scope="module")
def fp8_checkpoint(llama_fp8_dir) -> str:
    return str(llama_fp8_dir)


@pytest.fixture(scope="module")
def full(fp8_checkpoint) -> tuple[torch.nn.Module, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(fp8_checkpoint)
    with torch.no_grad():
        return model, model(**model_inputs("llama")).logits


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("llama")).logits


def test_explicit_device_map_with_disk_matches_full_load(fp8_checkpoint, full, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        fp8_checkpoint, device_map=LAYER_1_ON_DISK, offload_folder=str(tmp_path)
    )
    offloaded = model.model.layers[1].mlp.down_proj
    assert isinstance(offloaded, Fp8Linear)
    assert offloaded.weight.device.type == "meta" and offloaded.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(_logits(model), full[1])


def test_device_map_auto_spills_to_disk_and_matches_full_load(fp8_checkpoint, full, tmp_path):
    budget = int(0.8 * full[0].get_memory_footprint())  # room for some modules, not all
    model = AutoModelForCausalLM.from_pretrained(
        fp8_checkpoint, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(tmp_path)
    )
    assert {"cpu", "disk"} <= set(model.hf_device_map.values()), model.hf_device_map
    assert torch.equal(_logits(model), full[1])


def test_accelerate_disk_offload_stores_fp8_bytes_and_matches(fp8_checkpoint, full, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(fp8_checkpoint)
    disk_offload(model, str(tmp_path), execution_device="cpu")
    index = json.loads((tmp_path / "index.json").read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    assert index[name]["dtype"] == "float8_e4m3fn"
    numel = full[0].get_parameter(name).numel()
    assert (tmp_path / f"{name}.dat").stat().st_size == numel  # one byte per weight on disk
    assert model.get_parameter(name).device.type == "meta"
    assert torch.equal(_logits(model), full[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_offload_to_gpu_matches_full_gpu_load(fp8_checkpoint):
    on_gpu = {**dict.fromkeys(LAYER_1_ON_DISK, 0), "model.layers.1": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(fp8_checkpoint, device_map=on_gpu)
    reference = AutoModelForCausalLM.from_pretrained(fp8_checkpoint, device_map={"": 0})
    inputs = {k: v.cuda() for k, v in model_inputs("llama").items()}
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
