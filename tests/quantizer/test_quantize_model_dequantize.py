"""``quantize_model(model, Fp8Config(dequantize=True))`` is refused (reviewer R3 finding 8).

It returned an FP8 model and wrote ``dequantize: true`` into ``config.json``, so every reload
of the saved checkpoint came back in high precision without a word. ``from_pretrained`` with
the same config on a high-precision checkpoint is refused too."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config


def test_quantize_model_with_dequantize_is_refused_and_changes_nothing(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"dequantize=True") as err:
        hf_fp8.quantize_model(model, Fp8Config("dynamic", dequantize=True))
    assert "dequantize=False" in str(err.value)
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer) is torch.nn.Linear
    assert getattr(model.config, "quantization_config", None) is None
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
