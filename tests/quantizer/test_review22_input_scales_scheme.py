"""Static input scales stored in a checkpoint whose config says "dynamic" or "weight_only"
activations (reviewer R22 F2). ``from_pretrained`` loaded it and dropped every ``input_scale``
(transformers' UNEXPECTED table, "can be ignored"): the model ran with other activation
scales than the calibrated ones (logits 3.7 % off with "dynamic", 1.4 % with "weight_only"),
while ``hf-fp8 inspect`` / ``export`` refuse the same folder. Now refused before the weights
load, naming the tensor and the fix. With ``dequantize=True`` the scales are dropped on
purpose (a dequantized layer has no activation quantization): it loads, and matches the
static checkpoint dequantized."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import model_inputs

LAYER = "model.layers.0.mlp.down_proj"


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("llama")).logits


@pytest.fixture(scope="module")
def static_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A calibrated static checkpoint: every FP8 layer stores its ``input_scale``."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", activation_scale=0.05)
    )
    hf_fp8.calibrate(model, [model_inputs("llama")["input_ids"]], progress=False)
    path = tmp_path_factory.mktemp("r22_static")
    model.save_pretrained(path)
    assert f"{LAYER}.input_scale" in load_file(path / "model.safetensors")
    return path


def _with_scheme(src: Path, dst: Path, scheme: str) -> Path:
    """A copy of ``src`` whose config.json says ``activation_scheme=scheme``."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["activation_scheme"] = scheme
    qc["activation_granularity"] = None if scheme == "weight_only" else "tensor"
    qc["activation_scale"] = None
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("scheme", ["dynamic", "weight_only"])
def test_stored_input_scales_with_a_non_static_config_are_refused(static_dir, tmp_path, scheme):
    folder = _with_scheme(static_dir, tmp_path / "m", scheme)
    with pytest.raises(ValueError, match=r"input_scale") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    text = str(err.value)
    assert re.search(r"model\.layers\.\d+\.[\w.]+\.input_scale", text)  # a tensor named
    assert repr(scheme) in text and '"static"' in text  # what the config says, and the fix
    assert "config.json" in text and "remove" in text


def test_dequantize_flag_still_drops_them_and_matches_the_static_checkpoint(static_dir, tmp_path):
    """Reference: the static checkpoint loaded, then dequantized (its input scales play no
    part in a dequantized layer)."""
    folder = _with_scheme(static_dir, tmp_path / "m", "dynamic")
    reference = AutoModelForCausalLM.from_pretrained(static_dir).dequantize()
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Fp8Config("dynamic", dequantize=True)
    )
    assert type(model.get_submodule(LAYER)) is torch.nn.Linear
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=0)


def test_dynamic_checkpoint_without_input_scales_still_loads(llama_fp8_dir):
    names = load_file(Path(llama_fp8_dir) / "model.safetensors")
    assert not any(k.endswith("input_scale") for k in names)
    model = AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    assert model.get_submodule(LAYER).input_scale is None


def test_experts_input_scales_with_a_dynamic_config_are_refused(tmp_path):
    model = hf_fp8.quantize_model(
        tiny_qwen3_moe(), Fp8Config("static", activation_scale=0.05), skip=["lm_head"]
    )
    assert isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
    model.save_pretrained(tmp_path / "static")
    key = "model.layers.0.mlp.experts.down_proj_input_scale"
    assert key in load_file(tmp_path / "static" / "model.safetensors")
    folder = _with_scheme(tmp_path / "static", tmp_path / "m", "dynamic")
    # only the experts store input scales: the Fp8Linear ones are removed
    from safetensors.torch import save_file

    tensors = load_file(folder / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".input_scale")}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.\w+_input_scale") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "'dynamic'" in str(err.value)
