"""Reviewer R32 S1: ``save_pretrained(state_dict=sd)`` hands ``sd`` to hf_fp8's quantizer for
the length of that save (``SAVING``); a save of the same model started inside it (a callback
on the config save, a user's hook) without a ``state_dict`` got the outer save's ``sd``, not
the model's own tensors. The state dict passed is now handed to exactly one
``get_state_dict_and_metadata`` call, that of the save it was passed to.

References: the state dict passed (the outer save) and the model's own ``state_dict()`` (a
save without one)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config

NORM = "model.norm.weight"


def _fp8_llama(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )


def _nesting(model, folder, when: str, monkeypatch):
    """Make ``model``'s next save start a save of ``model`` into ``folder``, once: before
    transformers reads the state dict (``when='before'``: from the quantizer's
    ``get_state_dict_and_metadata``) or after it (from the config's save)."""
    done = []
    if when == "before":
        quantizer = model.hf_quantizer
        original = quantizer.get_state_dict_and_metadata

        def get_state_dict_and_metadata(m):
            if not done:
                done.append(True)
                model.save_pretrained(folder)
            return original(m)

        quantizer.get_state_dict_and_metadata = get_state_dict_and_metadata
    else:
        config_class = type(model.config)
        original = config_class.save_pretrained

        def save_config(config, directory, *args, **kwargs):
            if not done:
                done.append(True)
                model.save_pretrained(folder)
            return original(config, directory, *args, **kwargs)

        monkeypatch.setattr(config_class, "save_pretrained", save_config)
    return done


def test_save_nested_after_reading_the_state_dict_writes_the_models_own(
    tiny_model_dir, tmp_path, monkeypatch
):
    model = _fp8_llama(tiny_model_dir)
    own = model.state_dict()[NORM].clone()
    sd = dict(model.state_dict())
    sd[NORM] = torch.full_like(own, 3.0)
    done = _nesting(model, tmp_path / "inner", "after", monkeypatch)
    model.save_pretrained(tmp_path / "outer", state_dict=sd)
    assert done == [True]
    assert torch.equal(load_file(tmp_path / "outer" / "model.safetensors")[NORM], sd[NORM])
    assert torch.equal(load_file(tmp_path / "inner" / "model.safetensors")[NORM], own)


def test_save_nested_before_reading_the_state_dict_writes_the_models_own(
    tiny_model_dir, tmp_path, monkeypatch
):
    model = _fp8_llama(tiny_model_dir)
    own = model.state_dict()[NORM].clone()
    sd = dict(model.state_dict())
    sd[NORM] = torch.full_like(own, 3.0)
    done = _nesting(model, tmp_path / "inner", "before", monkeypatch)
    model.save_pretrained(tmp_path / "outer", state_dict=sd)
    assert done == [True]
    assert torch.equal(load_file(tmp_path / "outer" / "model.safetensors")[NORM], sd[NORM])
    assert torch.equal(load_file(tmp_path / "inner" / "model.safetensors")[NORM], own)


def test_next_save_after_a_state_dict_save_writes_the_models_own(tiny_model_dir, tmp_path):
    model = _fp8_llama(tiny_model_dir)
    own = model.state_dict()[NORM].clone()
    sd = dict(model.state_dict())
    sd[NORM] = torch.full_like(own, 3.0)
    model.save_pretrained(tmp_path / "a", state_dict=sd)
    model.save_pretrained(tmp_path / "b")
    assert torch.equal(load_file(tmp_path / "a" / "model.safetensors")[NORM], sd[NORM])
    assert torch.equal(load_file(tmp_path / "b" / "model.safetensors")[NORM], own)
