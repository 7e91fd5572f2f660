"""Gap 12.3: input scales set by hand on some static layers only (``set_input_scale``, not
``activation_scales``) saved a checkpoint that was refused on reload as one that lost scales
("lacks 13 input_scale tensor(s) ... belong in Fp8Config(activation_scales=...)"). Each shard
now records which input scales the save stored (safetensors metadata), so such a checkpoint
reloads as saved; one that lost a recorded scale, or lost the record with its tensors (a
rewrite without metadata), is still refused.

References: the saved model itself (save -> load -> compare by exact equality: scales and
logits once every unset layer gets the same scale in both)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import model_inputs

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"
EXPERTS = "model.layers.0.mlp.experts"


def _scales(model) -> dict[str, torch.Tensor | None]:
    """Every static input scale of ``model``, by tensor name (``None``: not set)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            out[f"{name}.input_scale"] = m.input_scale
        elif isinstance(m, Fp8Experts):
            for p in m.layout.projections:
                out[f"{name}.{p}_input_scale"] = getattr(m, f"{p}_input_scale")
    return {k: None if v is None else v.detach().clone() for k, v in out.items()}


def _fill_unset(model, value: float) -> None:
    for m in model.modules():
        if isinstance(m, Fp8Linear) and m.input_scale is None:
            m.set_input_scale(value)
        elif isinstance(m, Fp8Experts):
            for p in m.layout.projections:
                if getattr(m, f"{p}_input_scale") is None:
                    m.set_input_scale(p, value)


def _hand_set_llama(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )
    model.get_submodule(Q).set_input_scale(0.5)
    model.get_submodule(DOWN).set_input_scale(0.0123)
    return model


def _stored_scales(folder) -> list[str]:
    names = []
    for file in sorted(folder.glob("*.safetensors")):
        names += [k for k in load_file(file) if "input_scale" in k]
    return sorted(names)


def _drop(folder, key: str, *, keep_metadata: bool) -> None:
    """Remove tensor ``key`` from the single shard, keeping its metadata or not."""
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() if keep_metadata else {"format": "pt"}
    tensors = load_file(path)
    del tensors[key]
    save_file(tensors, path, metadata=metadata)


def test_llama_with_hand_set_scales_reloads_as_saved(tiny_model_dir, tmp_path):
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path)
    assert _stored_scales(tmp_path) == sorted([f"{Q}.input_scale", f"{DOWN}.input_scale"])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved, back = _scales(model), _scales(reloaded)
    assert back.keys() == saved.keys()
    for key, value in saved.items():
        assert (back[key] is None) == (value is None), key
        if value is not None:
            assert torch.equal(back[key], value), key
    assert float(reloaded.get_submodule(Q).input_scale) == 0.5
    _fill_unset(model, 0.03)
    _fill_unset(reloaded, 0.03)
    inputs = model_inputs("llama")
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)


def test_sharded_save_with_hand_set_scales_reloads_as_saved(tiny_model_dir, tmp_path):
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert float(reloaded.get_submodule(Q).input_scale) == 0.5
    assert float(reloaded.get_submodule(DOWN).input_scale) == pytest.approx(0.0123)
    assert reloaded.get_submodule("model.layers.0.self_attn.k_proj").input_scale is None


def test_moe_with_hand_set_per_expert_scales_reloads_as_saved(tmp_path):
    model = hf_fp8.quantize_model(tiny_qwen3_moe(), Fp8Config("static"), skip=["lm_head"])
    per_expert = torch.tensor([0.01, 0.02, 0.03, 0.04])
    model.get_submodule(EXPERTS).set_input_scale("down_proj", per_expert)
    model.get_submodule(Q).set_input_scale(0.25)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    experts = reloaded.get_submodule(EXPERTS)
    assert torch.equal(experts.down_proj_input_scale, per_expert)
    assert experts.gate_up_proj_input_scale is None
    assert float(reloaded.get_submodule(Q).input_scale) == 0.25
    _fill_unset(model, 0.02)
    _fill_unset(reloaded, 0.02)
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (2, 7))}
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)


def test_hand_set_scale_lost_after_saving_is_refused(tiny_model_dir, tmp_path):
    """The record (kept) names a scale the file no longer has: refused."""
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path)
    _drop(tmp_path, f"{DOWN}.input_scale", keep_metadata=True)
    with pytest.raises(CheckpointTensorError, match="lacks"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_the_refusal_names_the_scale_lost_after_saving(tiny_model_dir, tmp_path):
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path)
    _drop(tmp_path, f"{DOWN}.input_scale", keep_metadata=True)
    with pytest.raises(CheckpointTensorError) as err:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{DOWN}.input_scale: ") and "lacks 1 input_scale" in message
    assert "recorded as stored" in message and "Save the model again" in message


def test_rewritten_without_the_record_is_refused(tiny_model_dir, tmp_path):
    """A tool that rewrote the shard without its metadata (and lost a tensor): no record,
    so the partial checkpoint is refused as before."""
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path)
    _drop(tmp_path, f"{DOWN}.input_scale", keep_metadata=False)
    with pytest.raises(CheckpointTensorError, match="lacks 13 input_scale"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_calibrated_checkpoint_that_lost_scales_is_refused(tiny_model_dir, tmp_path):
    """Calibrated (every layer has a scale), saved, then one scale lost with the metadata
    kept: whatever the record says, the file lacks a scale it had."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )
    hf_fp8.calibrate(model, [model_inputs("llama")["input_ids"]], progress=False)
    model.save_pretrained(tmp_path)
    key = "model.layers.0.self_attn.k_proj.input_scale"
    _drop(tmp_path, key, keep_metadata=True)
    with pytest.raises(CheckpointTensorError, match=re.escape(key)):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_stored_scale_the_record_does_not_name_is_refused(tiny_model_dir, tmp_path):
    """A record that does not match the file (a scale added after saving, or a forged
    record): the partial checkpoint is refused as without a record."""
    model = _hand_set_llama(tiny_model_dir)
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    record = json.dumps([f"{Q}.input_scale"])  # DOWN's is stored but not recorded
    save_file(tensors, path, metadata={"format": "pt", "hf_fp8_input_scales": record})
    with pytest.raises(CheckpointTensorError, match="lacks 12 input_scale"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
