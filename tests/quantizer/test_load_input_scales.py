"""A static checkpoint that lost some of its calibrated ``input_scale`` tensors is refused
(reviewer R2 F2). Before, each missing one quietly took the config's fallback
``activation_scale`` (calibrated 0.000202 came back 0.05, outputs 1.6 % off). A checkpoint
saved before calibration (no input scale stored at all) still loads with the fallback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import LLAMA_LAYER_1_ON_DISK, model_inputs, tiny_mixtral

LAYER = "model.layers.0.mlp.down_proj"


def _drop(folder: Path, keep) -> list[str]:
    """Remove the ``*input_scale`` tensors for which ``keep(name)`` is false; returns them."""
    tensors = load_file(folder / "model.safetensors")
    dropped = sorted(k for k in tensors if k.endswith("input_scale") and not keep(k))
    for key in dropped:
        del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return dropped


@pytest.fixture(scope="module")
def calibrated_dir(tiny_model_dir, tmp_path_factory) -> Path:
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", activation_scale=0.05)
    )
    hf_fp8.calibrate(model, [model_inputs("llama")["input_ids"]])
    path = tmp_path_factory.mktemp("static_calibrated")
    model.save_pretrained(path)
    return path


def test_one_missing_calibrated_input_scale_is_refused(calibrated_dir, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in calibrated_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    _drop(folder, keep=lambda k: k != f"{LAYER}.input_scale")
    with pytest.raises(CheckpointTensorError, match=re.escape(f"{LAYER}.input_scale")) as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "calibrate" in str(err.value) and "model.safetensors" in str(err.value)


def test_no_stored_input_scale_keeps_the_config_fallback(calibrated_dir, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in calibrated_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    assert _drop(folder, keep=lambda k: False)  # saved "before calibration"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert float(model.get_submodule(LAYER).input_scale) == pytest.approx(0.05)


def test_experts_missing_one_input_scale_is_refused(tmp_path):
    model = hf_fp8.quantize_model(
        tiny_qwen3_moe(), Fp8Config("static", activation_scale=0.05), skip=["lm_head"]
    )
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8Experts)
    experts.down_proj_input_scale.data.fill_(0.003)  # as if calibrated
    model.save_pretrained(tmp_path)
    key = "model.layers.0.mlp.experts.down_proj_input_scale"
    assert key in load_file(tmp_path / "model.safetensors")
    _drop(tmp_path, keep=lambda k: k != key)
    with pytest.raises(CheckpointTensorError, match=re.escape(key)):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_complete_static_checkpoint_reloads_its_scales(calibrated_dir):
    model = AutoModelForCausalLM.from_pretrained(calibrated_dir)
    stored = load_file(calibrated_dir / "model.safetensors")[f"{LAYER}.input_scale"]
    assert torch.equal(
        model.get_submodule(LAYER).input_scale.detach().reshape(-1), stored.reshape(-1)
    )


# -- disk offload (reviewer R3 finding 4) ------------------------------------------------------
# Which scales the checkpoint stores is read from its tensor names, not from where a layer
# went: an offloaded layer's tensors stay on disk, and its input_scale is read at forward time.
OFFLOAD = dict(LLAMA_LAYER_1_ON_DISK)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_offloaded_layers_without_any_stored_input_scale_name_the_fix(calibrated_dir, tmp_path):
    """Saved before calibration (no input_scale at all) and loaded with layers on disk: the
    offloaded layers cannot take the fallback (accelerate reads every tensor from the
    checkpoint: KeyError at forward before); refused at load with the fix, not with the
    false "lacks 7 ... while it stores 7 others"."""
    folder = _copy(calibrated_dir, tmp_path / "ckpt")
    assert _drop(folder, keep=lambda k: False)
    with pytest.raises(
        CheckpointTensorError, match=r"model\.layers\.1\..*offloaded to disk"
    ) as err:
        AutoModelForCausalLM.from_pretrained(
            folder, device_map=OFFLOAD, offload_folder=tmp_path / "off"
        )
    assert "stores" not in str(err.value).split("offloaded")[0]
    assert "hf_fp8.calibrate" in str(err.value) and "'cpu'" in str(err.value)


def test_offloaded_layer_missing_its_calibrated_scale_is_refused(calibrated_dir, tmp_path):
    """An offloaded layer that lost its scale counted as stored: the load passed and the
    forward failed with KeyError."""
    folder = _copy(calibrated_dir, tmp_path / "ckpt")
    key = "model.layers.1.mlp.down_proj.input_scale"
    _drop(folder, keep=lambda k: k != key)
    with pytest.raises(CheckpointTensorError, match=re.escape(key)):
        AutoModelForCausalLM.from_pretrained(
            folder, device_map=OFFLOAD, offload_folder=tmp_path / "off"
        )


def test_offloaded_calibrated_checkpoint_matches_the_full_load(calibrated_dir, tmp_path):
    reference = AutoModelForCausalLM.from_pretrained(calibrated_dir)
    model = AutoModelForCausalLM.from_pretrained(
        calibrated_dir, device_map=OFFLOAD, offload_folder=tmp_path / "off"
    )
    inputs = model_inputs("llama")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)


def test_offloaded_static_mixtral_with_renamed_checkpoint_keys_loads(tmp_path):
    """Mixtral's experts are saved under their original names (``block_sparse_moe``) while the
    model calls them ``mlp``: an offloaded layer's stored scales were not found by name and a
    calibrated checkpoint was refused as partial (reviewer R6 2). Reference: the same model
    fully in memory."""
    import transformers as tf

    torch.manual_seed(0)
    tiny_mixtral().save_pretrained(tmp_path / "hp")
    model = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("static", activation_scale=0.05)
    )
    model.save_pretrained(tmp_path / "fp8")
    back = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8",
        device_map=dict(LLAMA_LAYER_1_ON_DISK),
        offload_folder=str(tmp_path / "offload"),
    )
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
