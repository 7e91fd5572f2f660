"""Card figures of a static model whose input scales are offloaded (R15 F3).

The digest of the static input scales cannot be taken from a layer offloaded to disk (its
scales are on meta). That "unknown" used to match any earlier card, so saving an offloaded
model with new scales into a folder whose card was measured with the old ones brought those
figures back. Reference: the scales stored in the folders themselves."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.hub.card import read_card_info
from tests.tiny_models import TINY

OFFLOAD = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))


def _input_scales(folder) -> dict[str, torch.Tensor]:
    weights = load_file(folder / "model.safetensors")
    return {k: v for k, v in weights.items() if k.endswith("input_scale")}


def _fidelity(folder) -> dict:
    return read_card_info((folder / "README.md").read_text(encoding="utf-8")).fidelity


@pytest.mark.parametrize("offload", [True, False])
def test_offloaded_static_model_does_not_take_back_old_figures(offload: bool, tmp_path) -> None:
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).save_pretrained(tmp_path / "hp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = tf.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hp", quantization_config=Fp8Config("static")
        )
        hf_fp8.calibrate(first, [_ids(0)], progress=False)
        hf_fp8.set_card_info(first, fidelity={"rel L2 (old scales)": 0.01})
        first.save_pretrained(tmp_path / "A")  # scales S1, figures measured with S1
        again = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "A")
        hf_fp8.calibrate(again, [_ids(1) * 0 + 5, _ids(2) % 7 + 3], progress=False)
        again.save_pretrained(tmp_path / "B")  # scales S2
        where = dict(device_map=OFFLOAD, offload_folder=str(tmp_path / "off")) if offload else {}
        moved = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "B", **where)
        old_scales = _input_scales(tmp_path / "A")
        moved.save_pretrained(tmp_path / "A")  # S2 into the folder whose card says S1
    new_scales = _input_scales(tmp_path / "A")
    assert any(not torch.equal(old_scales[k], new_scales[k]) for k in old_scales)
    assert _fidelity(tmp_path / "A") == {}
