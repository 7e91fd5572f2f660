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
