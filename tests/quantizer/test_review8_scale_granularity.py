"""A config.json whose weight_granularity disagrees with the stored weight scales (R7 finding 4):
refused before loading, naming the granularity the file holds, also with
``ignore_mismatched_sizes=True`` (transformers' own advice, which re-initialised the scales)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import model_inputs, model_output


def _saved(tiny_model_dir, path, config: Fp8Config, **edits) -> str:
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    model.save_pretrained(path)
    if edits:
        config_json = path / "config.json"
        data = json.loads(config_json.read_text())
        data["quantization_config"].update(edits)
        config_json.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("ignore", [False, True])
def test_row_scales_under_a_tensor_config_name_row(tiny_model_dir, tmp_path, ignore):
    path = _saved(tiny_model_dir, tmp_path, Fp8Config("dynamic"), weight_granularity="tensor")
    with pytest.raises(CheckpointTensorError, match="weight_granularity='row'") as err:
        AutoModelForCausalLM.from_pretrained(path, ignore_mismatched_sizes=ignore)
    assert "weight_scale" in str(err.value) and "config.json" in str(err.value)


def test_tensor_scales_under_a_row_config_name_tensor(tiny_model_dir, tmp_path):
    config = Fp8Config("dynamic", weight_granularity="tensor")
    path = _saved(tiny_model_dir, tmp_path, config, weight_granularity="row")
    with pytest.raises(CheckpointTensorError, match="weight_granularity='tensor'"):
        AutoModelForCausalLM.from_pretrained(path)


def test_block_scales_under_a_row_config_name_block(tiny_model_dir, tmp_path):
    config = Fp8Config("weight_only", weight_granularity="block", block_size=[32, 32])
    path = _saved(tiny_model_dir, tmp_path, config, weight_granularity="row")
    with pytest.raises(CheckpointTensorError, match="weight_granularity='block'"):
        AutoModelForCausalLM.from_pretrained(path)


def test_block_scales_under_another_block_size_name_it(tiny_model_dir, tmp_path):
    config = Fp8Config("weight_only", weight_granularity="block", block_size=[32, 32])
    path = _saved(tiny_model_dir, tmp_path, config, block_size=[64, 64])
    with pytest.raises(CheckpointTensorError, match=r"block_size=\[32, 32\]"):
        AutoModelForCausalLM.from_pretrained(path)


def test_matching_config_still_loads_exactly(tiny_model_dir, tmp_path):
    config = Fp8Config("weight_only", weight_granularity="block", block_size=[32, 32])
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    inputs = model_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(
            model_output(again, inputs), model_output(model, inputs), rtol=0, atol=0
        )
