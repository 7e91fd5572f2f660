"""Loading by repo id from a Hub cache laid out on disk (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Linear
from tests.bitwise import assert_states_bit_equal
from tests.hub.fake_hub import cache_folder
from tests.serialization.helpers import logits, quantized

REPO = "hf-fp8-tests/tiny-llama-fp8"


def test_from_pretrained_by_repo_id_reloads_bit_identical(fake_hub, tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), "static-tensor")
    model.save_pretrained(tmp_path / "fp8")
    cache_folder(fake_hub.cache_dir, REPO, tmp_path / "fp8")

    reloaded = AutoModelForCausalLM.from_pretrained(REPO)
    assert reloaded.hf_quantizer.pre_quantized
    assert isinstance(reloaded.model.layers[0].mlp.up_proj, Fp8Linear)
    assert_states_bit_equal(model, reloaded)
    assert torch.equal(logits(reloaded), logits(model))
    assert fake_hub.calls == []


def test_push_then_load_by_repo_id(fake_hub, tiny_model_dir):
    model = quantized(tiny_model_dir("llama"), "dynamic-block")
    model.push_to_hub(REPO)
    reloaded = AutoModelForCausalLM.from_pretrained(REPO)
    assert_states_bit_equal(model, reloaded)
    # the reloaded model remembers the card's facts for its next push
    assert reloaded._hf_fp8_card["base_model"] == Path(tiny_model_dir("llama")).name


def test_inspect_export_import_by_repo_id(fake_hub, tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    model.save_pretrained(tmp_path / "fp8")
    cache_folder(fake_hub.cache_dir, REPO, tmp_path / "fp8")
    assert hf_fp8.inspect_checkpoint(REPO).format == "hf_fp8"
    ct = hf_fp8.export(REPO, tmp_path / "ct")
    cache_folder(fake_hub.cache_dir, "hf-fp8-tests/ct", ct)
    back = hf_fp8.import_checkpoint("hf-fp8-tests/ct", tmp_path / "back")
    assert_states_bit_equal(model, AutoModelForCausalLM.from_pretrained(back))
    assert fake_hub.calls == []
