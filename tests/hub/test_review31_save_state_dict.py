"""R31 F3: ``save_pretrained(state_dict=...)`` of an hf_fp8 model wrote ``model.state_dict()``
instead of the state dict passed (``Trainer._save`` and FSDP / DeepSpeed gathered saves pass
one): transformers replaces it with what the quantizer's ``get_state_dict_and_metadata``
returns whenever a quantizer is attached. The state dict passed is now what is saved, checked
first (an FP8 layer's codes without their scales, fp8 codes where the model has no FP8 layer,
high-precision values where it stores codes: refused before anything is written), and the
input-scale record in the metadata describes that state dict, so it reloads as saved.

References: a high-precision model's ``save_pretrained(state_dict=...)`` (writes the state dict
passed), the model with the same edit applied in place (its logits), and a save without
``state_dict=`` (the files a Trainer-like full state dict must give)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import model_inputs

NORM = "model.norm.weight"
Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"
DOWN = "model.layers.1.mlp.down_proj"
EXPERTS = "model.layers.0.mlp.experts"
RECORD_KEY = "hf_fp8_input_scales"


def _fp8_llama(tiny_model_dir, scheme: str = "dynamic"):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config(scheme)
    )


def _saved(folder, key: str) -> torch.Tensor:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return f.get_tensor(key)


def _metadata(folder) -> dict:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return f.metadata()


def test_edited_state_dict_is_saved_as_by_a_float_model(tiny_model_dir, tmp_path):
    float_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    model = _fp8_llama(tiny_model_dir)
    for label, m in (("float", float_model), ("fp8", model)):
        sd = dict(m.state_dict())
        sd[NORM] = sd[NORM] * 2
        m.save_pretrained(tmp_path / label, state_dict=sd)
        # the reference: a high-precision model writes the state dict passed
        assert torch.equal(_saved(tmp_path / label, NORM), sd[NORM]), label
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    assert isinstance(back.get_submodule(Q), Fp8Linear)
    assert torch.equal(back.model.norm.weight, model.model.norm.weight * 2)


def test_edited_fp8_scale_reloads_as_the_model_with_that_edit(tiny_model_dir, tmp_path):
    model = _fp8_llama(tiny_model_dir)
    sd = dict(model.state_dict())
    sd[f"{Q}.weight_scale"] = sd[f"{Q}.weight_scale"] * 2
    model.save_pretrained(tmp_path, state_dict=sd)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(back.get_submodule(Q).weight_scale, sd[f"{Q}.weight_scale"])
    with torch.no_grad():
        model.get_submodule(Q).weight_scale.mul_(2)  # the same edit, in place
        inputs = model_inputs("llama")
        assert torch.equal(back(**inputs).logits, model(**inputs).logits)


def test_state_dict_passed_positionally_is_saved(tiny_model_dir, tmp_path):
    model = _fp8_llama(tiny_model_dir)
    sd = dict(model.state_dict())
    sd[NORM] = torch.full_like(sd[NORM], 0.5)
    model.save_pretrained(tmp_path, True, sd)  # (save_directory, is_main_process, state_dict)
    assert torch.equal(_saved(tmp_path, NORM), sd[NORM])


def test_trainer_like_full_state_dict_gives_the_same_files(tiny_model_dir, tmp_path):
    """``Trainer._save`` passes ``state_dict=model.state_dict()``: the same files as a save
    without it, the input-scale record included (scales set on some static layers only)."""
    model = _fp8_llama(tiny_model_dir, "static")
    model.get_submodule(Q).set_input_scale(0.5)
    model.get_submodule(DOWN).set_input_scale(0.0123)
    plain, passed = tmp_path / "a" / "out", tmp_path / "b" / "out"  # same name: same card
    model.save_pretrained(plain)
    model.save_pretrained(passed, state_dict=model.state_dict())
    files = sorted(p.name for p in plain.iterdir())
    assert files == sorted(p.name for p in passed.iterdir())
    assert "model.safetensors" in files
    for name in files:
        if name.endswith(".safetensors"):  # safetensors orders the metadata keys at random
            a, b = load_file(plain / name), load_file(passed / name)
            assert sorted(a) == sorted(b), name
            for key, value in a.items():
                assert value.dtype == b[key].dtype, key
                assert torch.equal(value.view(torch.uint8), b[key].view(torch.uint8)), key
            assert _metadata(plain) == _metadata(passed)
        else:
            assert (plain / name).read_bytes() == (passed / name).read_bytes(), name
    record = json.loads(_metadata(passed)[RECORD_KEY])
    assert record == sorted([f"{Q}.input_scale", f"{DOWN}.input_scale"])


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("drop_scale", f"{Q}.weight_scale"),
        ("drop_codes", f"{Q}.weight"),
        ("float_codes", f"{Q}.weight"),
        ("fp8_head", "lm_head.weight"),
        ("nan_scale", f"{Q}.weight_scale"),
        ("scale_shape", f"{Q}.weight_scale"),
    ],
)
def test_inconsistent_state_dict_is_refused_before_writing(tiny_model_dir, tmp_path, change, key):
    model = _fp8_llama(tiny_model_dir)
    sd = dict(model.state_dict())
    if change.startswith("drop"):
        del sd[key]
    elif change == "float_codes":  # high-precision values where the layer stores codes
        sd[key] = model.get_submodule(Q).dequantize().weight.detach()
    elif change == "fp8_head":  # fp8 codes without a scale
        sd[key] = sd[key].to(torch.float8_e4m3fn)
    elif change == "nan_scale":
        sd[key] = sd[key].clone()
        sd[key][3] = float("nan")
    else:
        sd[key] = sd[key][:8]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dest = tmp_path / "out"
    with pytest.raises(ValueError, match="save_pretrained\\(state_dict=") as err:
        model.save_pretrained(dest, state_dict=sd)
    assert key in str(err.value)
    assert "model.state_dict()" in str(err.value)  # the fix
    assert not dest.exists()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_state_dict_of_a_compiled_wrapper_is_refused_naming_the_prefix(tiny_model_dir, tmp_path):
    """``torch.compile(model).state_dict()`` names every tensor ``_orig_mod.<name>``: a float
    model writes those names (a checkpoint that does not reload); hf_fp8 refuses, saying why."""
    model = _fp8_llama(tiny_model_dir)
    sd = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"_orig_mod\..*unwrapped model"):
        model.save_pretrained(tmp_path / "out", state_dict=sd)
    assert not (tmp_path / "out").exists()


def test_experts_codes_without_their_scale_are_refused(tmp_path):
    model = hf_fp8.quantize_model(tiny_qwen3_moe(), Fp8Config("dynamic"))
    sd = dict(model.state_dict())
    assert sd[f"{EXPERTS}.down_proj"].dtype == torch.float8_e4m3fn
    del sd[f"{EXPERTS}.down_proj_weight_scale"]
    with pytest.raises(ValueError, match=f"{EXPERTS}.down_proj_weight_scale"):
        model.save_pretrained(tmp_path / "out", state_dict=sd)
    assert not (tmp_path / "out").exists()


def test_state_dict_without_some_input_scales_reloads_as_saved(tiny_model_dir, tmp_path):
    """A state dict that drops some calibrated input scales is saved as it is, with a warning,
    and its record names what it holds: the reload takes it as saved (those layers without a
    scale, as after a save with them unset), not as a checkpoint that lost scales."""
    model = _fp8_llama(tiny_model_dir, "static")
    for i, m in enumerate(m for m in model.modules() if isinstance(m, Fp8Linear)):
        m.set_input_scale(0.01 * (i + 1))
    sd = dict(model.state_dict())
    del sd[f"{DOWN}.input_scale"]
    with pytest.warns(UserWarning, match=f"lacks 1 input scale.*{DOWN}.input_scale"):
        model.save_pretrained(tmp_path, state_dict=sd)
    stored = sorted(k for k in load_file(tmp_path / "model.safetensors") if "input_scale" in k)
    assert f"{DOWN}.input_scale" not in stored
    assert json.loads(_metadata(tmp_path)[RECORD_KEY]) == stored
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.get_submodule(DOWN).input_scale is None
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear) and name != DOWN:
            assert torch.equal(back.get_submodule(name).input_scale, m.input_scale), name


def test_float_model_save_with_state_dict_is_transformers_own(tiny_model_dir, tmp_path):
    """The wrapper leaves high-precision models alone: their save writes the state dict
    passed, a partial one included (no hf_fp8 check)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    _fp8_llama(tiny_model_dir)  # an hf_fp8 load wraps save_pretrained
    sd = {NORM: torch.ones_like(model.model.norm.weight)}
    model.save_pretrained(tmp_path, state_dict=sd)
    assert sorted(load_file(tmp_path / "model.safetensors")) == [NORM]
