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


def test_calibrate_refuses_disk_offloaded_static_experts(tmp_path):
    from tests.tiny_models import tiny_mixtral

    torch.manual_seed(0)
    source = tmp_path / "mixtral"
    tiny_mixtral().save_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(
        source, quantization_config=Fp8Config("static", activation_scale=0.05)
    )
    static = tmp_path / "static"
    model.save_pretrained(static)
    device_map = {"model.layers.1": "disk"} | {
        name: "cpu"
        for name in ("model.embed_tokens", "model.layers.0", "model.norm", "model.rotary_emb")
    }
    device_map["lm_head"] = "cpu"
    offloaded = AutoModelForCausalLM.from_pretrained(
        static, device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    experts = offloaded.model.layers[1].mlp.experts
    assert experts.gate_up_proj.is_meta  # really offloaded
    with pytest.raises(ValueError, match=r"offloaded.*model\.layers\.1\.mlp\.experts"):
        hf_fp8.calibrate(offloaded, [model_inputs("llama")], progress=False)
