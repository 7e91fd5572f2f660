"""Reviewer R7 finding 1: ``calibrate`` on a model whose static layers are offloaded (their
tensors on the meta device, read from disk by accelerate's hooks at forward time) returned the
new scales but the forward and ``save_pretrained`` kept the old on-disk ones. It now refuses
before running a batch, naming the layers and the fix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import LLAMA_LAYER_1_ON_DISK, model_inputs


@pytest.fixture(scope="module")
def static_dir(tiny_model_dir, tmp_path_factory):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", activation_scale=0.05)
    )
    hf_fp8.calibrate(model, [model_inputs("llama")], progress=False)
    path = tmp_path_factory.mktemp("llama_static")
    model.save_pretrained(path)
    return path


def _scales(model) -> dict[str, float]:
    return {
        n: float(m.input_scale)
        for n, m in model.named_modules()
        if isinstance(m, Fp8Linear) and not m.input_scale.is_meta
    }


def test_calibrate_refuses_disk_offloaded_static_layers(static_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        static_dir, device_map=dict(LLAMA_LAYER_1_ON_DISK), offload_folder=str(tmp_path)
    )
    assert model.model.layers[1].mlp.down_proj.weight.is_meta  # really offloaded
    before = _scales(model)
    with torch.no_grad():
        reference = model(**model_inputs("llama")).logits
    with pytest.raises(ValueError, match=r"offloaded") as err:
        hf_fp8.calibrate(model, [model_inputs("llama", seed=1)], progress=False)
    text = str(err.value)
    assert "model.layers.1.mlp.down_proj" in text
    assert "model.layers.0." not in text  # only the offloaded ones are named
    assert "save_pretrained" in text and "device_map" in text  # the fix
    assert _scales(model) == before  # nothing half-written
    with torch.no_grad():
        assert torch.equal(model(**model_inputs("llama")).logits, reference)
