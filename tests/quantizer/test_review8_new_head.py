"""An FP8 checkpoint loaded with a new task head (R7 finding 3): the head the checkpoint does not
store stays in high precision and is newly initialised, as on an on-the-fly load; a layer whose
fp8 weight is stored without its scale is still refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs


def _classifier(path, **kwargs):
    return AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=3, pad_token_id=0, **kwargs
    )


def test_new_classifier_head_stays_high_precision_over_the_fp8_body(llama_fp8_dir, tmp_path):
    model = _classifier(llama_fp8_dir)
    assert type(model.score) is torch.nn.Linear
    assert model.score.weight.dtype == torch.float32 and model.score.weight.abs().sum() > 0
    assert "score" in model.config.quantization_config.modules_to_not_convert
    # the body is the FP8 body a CausalLM load gives, bit for bit
    causal = AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    inputs = model_inputs("llama")
    with torch.no_grad():
        body = model.model(**inputs).last_hidden_state
        expected = causal.model(**inputs).last_hidden_state
    torch.testing.assert_close(body, expected, rtol=0, atol=0)
    # saved and reloaded: the trained-from-scratch head comes back as it was
    model.save_pretrained(tmp_path)
    again = _classifier(tmp_path)
    assert type(again.score) is torch.nn.Linear
    torch.testing.assert_close(again.score.weight, model.score.weight, rtol=0, atol=0)


def test_lora_training_with_the_new_head(llama_fp8_dir):
    peft = pytest.importorskip("peft")
    model = _classifier(llama_fp8_dir)
    frozen = model.model.layers[0].self_attn.q_proj.weight.clone()
    model = peft.get_peft_model(
        model, peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    )
    head = model.base_model.model.score.modules_to_save["default"]
    head_before = head.weight.detach().clone()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    inputs = model_inputs("llama")
    labels = torch.tensor([0, 2])
    losses = []
    for _ in range(8):
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(head.weight, head_before)  # the head trains
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert torch.equal(base.weight.view(torch.uint8), frozen.view(torch.uint8))  # fp8 frozen


def test_stored_fp8_weight_without_its_scale_is_still_refused(llama_fp8_dir, tmp_path):
    shutil.copytree(llama_fp8_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_renamed_checkpoint_keys_are_followed(tmp_path):
    """Mixtral's checkpoint says block_sparse_moe where the model says mlp (a loader renaming):
    the stored experts are found under the model's names; only score is new."""
    import transformers as tf

    from hf_fp8.modules.fp8_experts import Fp8Experts
    from hf_fp8.quantizer.kept_modules import file_tensor_names
    from hf_fp8.quantizer.new_layers import loaded_names
    from tests.tiny_models import tiny_mixtral

    torch.manual_seed(0)
    tiny_mixtral().save_pretrained(tmp_path / "hp")
    causal = AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("dynamic")
    )
    causal.save_pretrained(tmp_path / "fp8")
    stored = file_tensor_names([str(tmp_path / "fp8" / "model.safetensors")])
    assert any(".block_sparse_moe." in k for k in stored)
    assert "model.layers.0.mlp.experts.down_proj_weight_scale" in loaded_names(causal, stored)
    model = tf.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "fp8", num_labels=3, pad_token_id=0
    )
    assert type(model.score) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    inputs = model_inputs("llama")
    with torch.no_grad():
        body = model.model(**inputs).last_hidden_state
        expected = causal.model(**inputs).last_hidden_state
    torch.testing.assert_close(body, expected, rtol=0, atol=0)
