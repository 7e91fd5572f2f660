"""Figures measured in one compute dtype do not describe the weights in another (R14 4).

``hf-fp8 quantize --out X --measure 8 --dtype float32`` then ``... --overwrite --dtype bfloat16``
(no ``--measure``) kept the float32 figures in the bfloat16 card and in the pushed card. A card's
figures now carry over (into a card merged with an earlier one, or from the card of the folder
a model was loaded from, or across a cast of the model) only when the compute dtype they were
measured in is known and is the dtype of the weights described; the base model still carries
over. The reference for "stale" is the figure recorded for float32: it must not reappear.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.hub import CardInfo, info_from_model, push_folder, read_card_info
from hf_fp8.hub.card import merge_card, same_model
from hf_fp8.hub.card_info import _scheme_dict

FP32 = {"logits relative L2 vs high precision": 0.080242}
BASE = "hf-fp8-tests/tiny-llama"


def _card(folder) -> CardInfo:
    return read_card_info((folder / "README.md").read_text(encoding="utf-8"))


def _quantized(tiny_model_dir, dtype: torch.dtype, fidelity: dict | None = None):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config("dynamic"), dtype=dtype
    )
    hf_fp8.set_card_info(model, base_model=BASE, fidelity=fidelity)
    return model


def _info(dtype: str | None, fidelity: dict | None = None) -> CardInfo:
    scheme = _scheme_dict(hf_fp8.Fp8Config("dynamic"))
    return CardInfo(
        architecture="LlamaForCausalLM",
        base_model=BASE,
        compute_dtype=dtype,
        scheme=scheme,
        fidelity=dict(fidelity or {}),
    )


@pytest.mark.parametrize(
    ("old", "new", "carried"),
    [
        ("float32", "float32", True),
        ("float32", "bfloat16", False),
        ("bfloat16", "float16", False),
        (None, "bfloat16", False),  # an earlier card that records no dtype: unknown
        ("float32", None, False),
        (None, None, True),  # nothing known differs (hand-built cards)
    ],
)
def test_merge_carries_figures_only_for_the_same_compute_dtype(old, new, carried):
    previous = merge_card(None, _info(old, FP32))
    merged = read_card_info(merge_card(previous, _info(new)))
    assert merged.fidelity == (FP32 if carried else {})
    assert merged.base_model == BASE  # the base model is the same whatever the dtype
    assert same_model(_info(old), _info(new))


def test_requantize_in_bfloat16_over_a_float32_card_drops_its_figures(
    tiny_model_dir, tmp_path, fake_hub
):
    out = tmp_path / "m"
    _quantized(tiny_model_dir, torch.float32, FP32).save_pretrained(out)
    assert _card(out).fidelity == FP32 and _card(out).compute_dtype == "float32"

    _quantized(tiny_model_dir, torch.bfloat16).save_pretrained(out)  # the --overwrite path
    card = _card(out)
    assert card.compute_dtype == "bfloat16" and card.fidelity == {}
    assert card.base_model == BASE
    assert "0.080242" not in (out / "README.md").read_text()

    push_folder(out, "me/m-fp8")
    pushed = fake_hub.commits[-1].files["README.md"].decode()
    assert read_card_info(pushed).fidelity == {} and "0.080242" not in pushed


def test_requantize_in_the_same_dtype_keeps_its_figures(tiny_model_dir, tmp_path):
    out = tmp_path / "m"
    _quantized(tiny_model_dir, torch.float32, FP32).save_pretrained(out)
    _quantized(tiny_model_dir, torch.float32).save_pretrained(out)
    assert _card(out).fidelity == FP32


def test_loading_a_float32_checkpoint_in_bfloat16_drops_its_figures(tiny_model_dir, tmp_path):
    src = tmp_path / "fp32"
    _quantized(tiny_model_dir, torch.float32, FP32).save_pretrained(src)
    same = AutoModelForCausalLM.from_pretrained(src)
    assert info_from_model(same).fidelity == FP32  # same dtype: they still hold

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert info_from_model(model).fidelity == {} and info_from_model(model).base_model == BASE
    model.save_pretrained(tmp_path / "bf16")
    assert _card(tmp_path / "bf16").fidelity == {}


def test_a_cast_after_recording_figures_drops_them(tiny_model_dir, tmp_path):
    model = _quantized(tiny_model_dir, torch.float32, FP32)
    model.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="measured in float32.*bfloat16"):
        info = info_from_model(model)
    assert info.fidelity == {} and info.compute_dtype == "bfloat16"
    model.save_pretrained(tmp_path / "cast")
    assert _card(tmp_path / "cast").fidelity == {}
