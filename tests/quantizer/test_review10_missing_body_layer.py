"""A pre-quantized checkpoint that lost a body layer's tensors (R10 finding 1): refused, named.

Only a task head outside ``model.base_model`` (``score`` of a CausalLM folder loaded for
sequence classification) is new and kept in high precision; a layer of the body the files lack
(both ``weight`` and ``weight_scale`` gone: a damaged or truncated file) was loaded as a
randomly initialised high-precision ``nn.Linear`` and written into ``modules_to_not_convert``."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

LOST = "model.layers.1.mlp.up_proj"


def _without_layer(src, dst):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(dst / "model.safetensors")
    removed = [k for k in tensors if k.startswith(f"{LOST}.")]
    assert sorted(removed) == [f"{LOST}.weight", f"{LOST}.weight_scale"]
    for key in removed:
        del tensors[key]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_body_layer_missing_from_the_checkpoint_is_refused(llama_fp8_dir, tmp_path):
    folder = _without_layer(llama_fp8_dir, tmp_path)
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\).*mlp\.up_proj\.weight"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_body_layer_missing_is_refused_under_a_new_head_and_without_a_head(llama_fp8_dir, tmp_path):
    folder = _without_layer(llama_fp8_dir, tmp_path)
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\).*mlp\.up_proj\.weight"):
        AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, pad_token_id=0)
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\).*mlp\.up_proj\.weight"):
        AutoModel.from_pretrained(folder)  # the base model itself: nothing in it is a head


def _bert_mlm_fp8(folder):
    import torch
    import transformers as tf

    from hf_fp8 import Fp8Config

    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    tf.BertForMaskedLM(config).save_pretrained(folder / "hp")
    model = tf.AutoModelForMaskedLM.from_pretrained(
        folder / "hp", quantization_config=Fp8Config("dynamic")
    )
    model.save_pretrained(folder / "fp8")
    return model, folder / "fp8"


def test_a_checkpoint_of_another_class_gets_its_missing_body_module_as_new(tmp_path):
    """A masked-LM checkpoint stores no pooler: loaded for sequence classification, the pooler
    is new (nothing under bert.pooler), kept in high precision, as transformers initialises it;
    the encoder loads FP8 exactly as saved (R11 1: refused as a lost body layer)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from hf_fp8 import Fp8Linear

    mlm, folder = _bert_mlm_fp8(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    assert type(model.bert.pooler.dense) is torch.nn.Linear
    assert isinstance(model.bert.encoder.layer[0].attention.self.query, Fp8Linear)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.bert(ids).last_hidden_state
        want = mlm.bert(ids).last_hidden_state
    assert torch.equal(got, want)


def test_a_checkpoint_of_another_class_missing_one_of_a_modules_layers_is_refused(tmp_path):
    """Another class, but the module holding the lost layer stores its siblings: damage."""
    from transformers import AutoModelForSequenceClassification

    _, folder = _bert_mlm_fp8(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    lost = "bert.encoder.layer.1.attention.self.key"
    for key in [k for k in tensors if k.startswith(f"{lost}.")]:
        del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 3 tensor\(s\).*attention\.self\.key\.weight"):
        AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
