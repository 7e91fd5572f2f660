"""Reviewer R7 finding 3: a model re-quantized into the same folder with other skips or another
weight scale method, and not measured, kept the previous run's measured error in its card
(``same_model`` compared only format, scheme words, base model and architecture). The
figures now carry over only when the whole ``quantization_config`` is the same where both
cards record one."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.hub import CardInfo, read_card_info
from hf_fp8.hub.card import same_model

FIGURE = {"logits relative error": 0.080242}


def _info(**config) -> CardInfo:
    info = CardInfo(scheme={"activation_scheme": "dynamic"}, architecture="LlamaForCausalLM")
    info.quantization_config = Fp8Config("dynamic", **config).to_dict()
    return info


@pytest.mark.parametrize(
    "other",
    [{"weight_scale_method": "mse"}, {"modules_to_not_convert": ["lm_head", "q_proj"]}],
    ids=["scale-method", "skips"],
)
def test_same_model_compares_the_whole_quantization_config(other):
    assert same_model(_info(), _info())
    assert not same_model(_info(), _info(**other))
    unknown = _info()
    unknown.quantization_config = None  # e.g. a card rendered from a checkpoint folder
    assert same_model(_info(), unknown) and same_model(unknown, _info())


def _save(source: str, folder, config: Fp8Config, fidelity: dict | None = None) -> CardInfo:
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config)
    if fidelity:
        hf_fp8.set_card_info(model, fidelity=fidelity)
    model.save_pretrained(folder)
    return read_card_info((folder / "README.md").read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "other",
    [{"weight_scale_method": "mse"}, {"modules_to_not_convert": ["q_proj"]}],
    ids=["scale-method", "skips"],
)
def test_requantized_model_saved_into_the_folder_drops_the_old_figures(
    tiny_model_dir, tmp_path, other
):
    source = tiny_model_dir("llama")
    first = _save(source, tmp_path, Fp8Config("dynamic"), FIGURE)
    assert first.fidelity == FIGURE
    second = _save(source, tmp_path, Fp8Config("dynamic", **other))
    assert second.fidelity == {}
    assert "0.080242" not in (tmp_path / "README.md").read_text(encoding="utf-8")


def test_the_same_quantization_saved_again_keeps_the_figures(tiny_model_dir, tmp_path):
    source = tiny_model_dir("llama")
    _save(source, tmp_path, Fp8Config("dynamic"), FIGURE)
    assert _save(source, tmp_path, Fp8Config("dynamic")).fidelity == FIGURE
