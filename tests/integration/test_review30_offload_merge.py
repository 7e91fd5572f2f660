"""Merging LoRA adapters into an FP8 model with a layer offloaded to disk (reviewer R30 F3).

``merge_adapter()`` / ``merge_and_unload()`` raised ``AttributeError: _hf_hook`` from peft's
``onload_layer`` (the merged dense copy had lost accelerate's hook) and left the model
half-merged. The same flow merges on a high-precision model. Reference: the same flow on the
dequantized model (weight-only FP8, whose forward equals the dequantized one), saved and loaded
with the same device_map. (peft builds the adapters of an offloaded layer on the meta device, on
either model, where they hold no values: the tests put them on the CPU first.)
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import LLAMA_LAYER_1_ON_DISK, model_inputs

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    """(the FP8 checkpoint, its dequantized model saved in high precision)."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("weight_only")
    )
    fp8 = tmp_path_factory.mktemp("llama_fp8_weight_only")
    model.save_pretrained(fp8)
    dense = tmp_path_factory.mktemp("llama_dequantized")
    model.dequantize().save_pretrained(dense)
    return fp8, dense


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("llama")).logits


def _load(path, tmp_path, name):
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map=LLAMA_LAYER_1_ON_DISK, offload_folder=str(tmp_path / name)
    )
    return get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS))


def _pair(folders, tmp_path):
    """(the FP8 model with layer 1 on disk, the dequantized reference so), same adapters."""
    offloaded, reference = (_load(path, tmp_path, f"offload{i}") for i, path in enumerate(folders))
    for model in (offloaded, reference):
        for name, module in model.named_modules():
            if "lora_" in name and any(p.is_meta for p in module.parameters(recurse=False)):
                module.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1)
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in offloaded.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
                ref_params[name].copy_(param)
    q1 = offloaded.base_model.model.model.layers[1].self_attn.q_proj
    assert isinstance(q1.get_base_layer(), Fp8Linear) and q1.get_base_layer().weight.is_meta
    return offloaded, reference


def test_merge_and_unload_with_a_layer_on_disk_matches_the_dequantized_merge(folders, tmp_path):
    offloaded, reference = _pair(folders, tmp_path)
    merged = offloaded.merge_and_unload()
    expected = _logits(reference.merge_and_unload())
    for i in (0, 1):
        q = merged.model.layers[i].self_attn.q_proj
        assert type(q) is torch.nn.Linear, i
    assert merged.model.layers[1].self_attn.q_proj.weight.is_meta  # still offloaded
    assert torch.equal(_logits(merged), expected)


def test_merge_adapter_then_unmerge_with_a_layer_on_disk(folders, tmp_path):
    offloaded, reference = _pair(folders, tmp_path)
    before = _logits(offloaded)
    offloaded.merge_adapter()
    reference.merge_adapter()
    layers = offloaded.base_model.model.model.layers
    assert all(layers[i].self_attn.q_proj.merged for i in (0, 1))
    assert torch.equal(_logits(offloaded), _logits(reference))
    trainable = [n for n, p in offloaded.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    offloaded.unmerge_adapter()
    reference.unmerge_adapter()

    base = layers[1].self_attn.q_proj.get_base_layer()
    assert isinstance(base, Fp8Linear) and base.weight.is_meta  # the FP8 layer, offloaded
    assert torch.equal(_logits(offloaded), before)
    torch.testing.assert_close(_logits(reference), before)  # the reference: rounding only


def test_dora_on_an_offloaded_fp8_layer_is_refused_with_the_fix(folders, tmp_path):
    """R30 t16: DoRA reads the base weight, which an offloaded layer does not hold (peft fails on
    the high-precision model too); it crashed with aten::equal on meta tensors."""
    model = AutoModelForCausalLM.from_pretrained(
        folders[0], device_map=LLAMA_LAYER_1_ON_DISK, offload_folder=str(tmp_path / "offload")
    )
    config = LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.q_proj.*offloaded") as err:
        get_peft_model(model, config)
    assert "without offloading" in str(err.value)
    assert not any(hasattr(m, "lora_A") for m in model.modules())  # the model as it was


def test_dora_on_an_fp8_model_on_the_meta_device_as_on_the_dequantized_one(folders):
    """A model on the meta device (to be loaded later) holds no values: DoRA is set up as on the
    dequantized model moved to meta (it crashed with aten::equal on meta tensors)."""
    fp8 = AutoModelForCausalLM.from_pretrained(folders[0])
    reference = AutoModelForCausalLM.from_pretrained(folders[0]).dequantize().to("meta")
    config = dict(r=4, target_modules=["q_proj"], use_dora=True)
    peft_model = get_peft_model(fp8.to("meta"), LoraConfig(**config))
    reference = get_peft_model(reference, LoraConfig(**config))
    adapters = {n: p.shape for n, p in peft_model.named_parameters() if "lora_" in n}
    assert adapters == {n: p.shape for n, p in reference.named_parameters() if "lora_" in n}
    assert adapters and all(p.is_meta for p in peft_model.parameters())
