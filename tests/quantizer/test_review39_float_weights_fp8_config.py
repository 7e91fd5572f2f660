"""R39 F6: a config.json with an hf_fp8 quantization_config over all-float weights (a float
checkpoint whose config.json got the FP8 one copied in). The advice used to be "add 'down_proj'
to modules_to_not_convert" (following it led to the next layer); no layer of the checkpoint is
FP8, so the error says to remove the quantization_config (or quantize on the fly without it)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError


def _llama(folder):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_all_float_weights_under_an_fp8_config_say_remove_it(tmp_path):
    float_dir = _llama(tmp_path / "float")
    fp8_dir = tmp_path / "fp8"
    AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=Fp8Config("dynamic")
    ).save_pretrained(fp8_dir)
    mixed = tmp_path / "mixed"
    shutil.copytree(float_dir, mixed)
    config = json.loads((mixed / "config.json").read_text())
    config["quantization_config"] = json.loads((fp8_dir / "config.json").read_text())[
        "quantization_config"
    ]
    (mixed / "config.json").write_text(json.dumps(config))
    for kwargs in ({}, {"quantization_config": Fp8Config("dynamic")}):
        with pytest.raises(CheckpointTensorError) as err:
            AutoModelForCausalLM.from_pretrained(mixed, **kwargs)
        text = str(err.value)
        assert "no FP8 tensor" in text and "remove" in text, text
        assert str(mixed / "config.json") in text
        assert "add 'down_proj'" not in text
    # following the advice: without the quantization_config it quantizes on the fly
    del config["quantization_config"]
    (mixed / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(mixed, quantization_config=Fp8Config("dynamic"))
    ref = AutoModelForCausalLM.from_pretrained(fp8_dir)
    ids = torch.tensor([[1, 5, 9, 17]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_one_layer_kept_in_high_precision_still_names_the_skip_list(tmp_path):
    # the hint for a checkpoint that does hold FP8 layers is unchanged
    float_dir = _llama(tmp_path / "float")
    fp8_dir = tmp_path / "fp8"
    AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=Fp8Config("dynamic", modules_to_not_convert=["down_proj"])
    ).save_pretrained(fp8_dir)
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointTensorError, match=r"add 'down_proj' to that list"):
        AutoModelForCausalLM.from_pretrained(fp8_dir)
