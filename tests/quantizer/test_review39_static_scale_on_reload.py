"""R39 F3: a static FP8 checkpoint saved before calibration, reloaded with
``Fp8Config("static", activation_scale=...)`` / ``activation_scales=...``: the passed scales fill
the input scales the checkpoint does not store (with a warning); stored ones are kept (a passed
config never overrides a saved checkpoint). Before, transformers dropped the passed scales and
the forward asked for exactly what the user had passed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 3, 7]])
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("r39f3")
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
    LlamaForCausalLM(config).save_pretrained(root / "float")
    model = AutoModelForCausalLM.from_pretrained(
        root / "float", quantization_config=Fp8Config("static")
    )
    model.save_pretrained(root / "uncalibrated")  # saved before calibration
    model.get_submodule(Q).set_input_scale(0.25)  # one layer given a scale, then saved
    model.save_pretrained(root / "one_scale")
    return root


def _reference(folders, **scales):
    model = AutoModelForCausalLM.from_pretrained(folders / "float")
    return hf_fp8.quantize_model(model, Fp8Config("static", **scales))


def test_activation_scale_fills_an_uncalibrated_checkpoint(folders):
    with pytest.warns(UserWarning, match=r"filled the input scales of 14 layer"):
        model = AutoModelForCausalLM.from_pretrained(
            folders / "uncalibrated", quantization_config=Fp8Config("static", activation_scale=0.05)
        )
    ref = _reference(folders, activation_scale=0.05)
    assert float(model.get_submodule(Q).input_scale) == pytest.approx(0.05)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_activation_scales_fill_only_the_layers_named(folders):
    scales = {Q: 0.07, "model.layers.1.mlp.down_proj": 0.09}
    with pytest.warns(UserWarning, match=r"filled the input scales of 2 layer"):
        model = AutoModelForCausalLM.from_pretrained(
            folders / "uncalibrated",
            quantization_config=Fp8Config("static", activation_scales=scales),
        )
    assert float(model.get_submodule(Q).input_scale) == pytest.approx(0.07)
    assert model.model.layers[0].mlp.up_proj.input_scale is None  # still to calibrate


def test_a_stored_scale_is_kept(folders):
    with pytest.warns(UserWarning, match=r"1 layer\(s\) whose input_scale the checkpoint stores"):
        model = AutoModelForCausalLM.from_pretrained(
            folders / "one_scale", quantization_config=Fp8Config("static", activation_scale=0.05)
        )
    assert float(model.get_submodule(Q).input_scale) == pytest.approx(0.25)  # stored: kept
    k_proj = model.model.layers[0].self_attn.k_proj
    assert float(k_proj.input_scale) == pytest.approx(0.05)  # not stored: filled


def test_scales_for_a_dynamic_checkpoint_are_refused(folders, tmp_path):
    AutoModelForCausalLM.from_pretrained(
        folders / "float", quantization_config=Fp8Config("dynamic")
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"activation_scheme='dynamic'.*static checkpoints"):
        AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=Fp8Config("static", activation_scale=0.05)
        )
