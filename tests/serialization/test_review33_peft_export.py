"""Reviewer R33 F8: exporting a peft-wrapped hf_fp8 model failed with ``FileNotFoundError …
.hf_fp8-tmp-… has no config.json`` (peft's ``save_pretrained`` writes an adapter, not a
model). The export now refuses a peft model (or a model holding peft adapter layers) before
anything is written, saying to ``merge_and_unload()`` (then quantize) or to export the base
model; ``unload()`` gives back an FP8 model that exports."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.serialization import export_checkpoint

FORMATS = ("compressed-tensors", "vllm-fp8")
LORA = dict(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _fp8_model(path: str):
    config = Fp8Config("dynamic", weight_granularity="tensor", activation_granularity="tensor")
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config)


def _refused(model, out, fmt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((TypeError, ValueError)) as err:
            export_checkpoint(model, out, fmt)
    message = str(err.value)
    assert "peft" in message, message
    assert "merge_and_unload()" in message, message
    assert "hf-fp8-tmp" not in message and ".hf_fp8-tmp" not in message
    assert not out.exists()
    assert not list(out.parent.glob(".*tmp*"))  # no temporary folder left behind
    return message


@pytest.mark.parametrize("fmt", FORMATS)
def test_peft_model_export_is_refused(tiny_model_dir, tmp_path, fmt):
    model = get_peft_model(_fp8_model(tiny_model_dir("llama")), LoraConfig(**LORA))
    message = _refused(model, tmp_path / "out", fmt)
    assert "model.unload()" in message, message  # the route that keeps the FP8 base


def test_base_model_with_adapter_layers_is_refused(tiny_model_dir, tmp_path):
    """``get_base_model()`` still holds the LoRA layers: refused too (its adapters would be
    dropped or written as stray tensors)."""
    model = get_peft_model(_fp8_model(tiny_model_dir("llama")), LoraConfig(**LORA))
    message = _refused(model.get_base_model(), tmp_path / "out", "compressed-tensors")
    assert "q_proj" in message, message


def test_unloaded_model_exports_the_fp8_base(tiny_model_dir, tmp_path):
    base = _fp8_model(tiny_model_dir("llama"))
    reference = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(**LORA))
    _refused(model, tmp_path / "refused", "compressed-tensors")
    unloaded = model.unload()  # the FP8 base, adapters dropped
    assert isinstance(unloaded.model.layers[0].self_attn.q_proj, Fp8Linear)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_checkpoint(unloaded, tmp_path / "out", "compressed-tensors")
    state = load_file(out / "model.safetensors")
    assert not [k for k in state if "lora" in k]
    for key in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale",
    ):
        want = reference[key]
        got = state[key].reshape(want.shape)
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
