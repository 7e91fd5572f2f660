"""An FP8 checkpoint loaded without any quantization_config is refused (reviewer R2 F8).

Before: ``config.json`` without ``quantization_config``, or ``config=`` taken from the base
model, loaded the fp8 codes into ``nn.Linear`` as plain values and dropped every scale, with
only transformers' UNEXPECTED report (logits off by 1.43 relative), even with hf_fp8 imported.
Checkpoints that carry their own ``quantization_config`` (hf_fp8, compressed-tensors) load as
before.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_fp8 import patches
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import model_inputs, model_output

LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def fp8_dir(llama_fp8_dir) -> Path:
    return llama_fp8_dir


def _without_config(fp8_dir: Path, dst: Path) -> Path:
    shutil.copytree(fp8_dir, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_config_json_without_quantization_config_is_refused(fp8_dir, tmp_path):
    folder = _without_config(fp8_dir, tmp_path / "ckpt")
    with pytest.raises(
        CheckpointTensorError, match=r"^model\.layers\.\d\.[\w.]+\.weight in .*\(F8_E4M3\)"
    ) as err:
        AutoModelForCausalLM.from_pretrained(folder)
    message = str(err.value)
    assert "weight_scale" in message and "restore" in message and "config.json" in message


def test_base_model_config_passed_with_an_fp8_folder_is_refused(fp8_dir, tiny_model_dir):
    base = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    with pytest.raises(CheckpointTensorError, match=r"do not pass the base model's config"):
        AutoModelForCausalLM.from_pretrained(fp8_dir, config=base)


def test_sharded_checkpoint_with_the_scale_in_another_shard_is_refused(fp8_dir, tmp_path):
    folder = _without_config(fp8_dir, tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    scales = {k for k in tensors if k.endswith("weight_scale")}
    parts = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in scales},
        "model-00002-of-00002.safetensors": {k: tensors[k] for k in scales},
    }
    weight_map = {}
    for file, part in parts.items():
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointTensorError, match=re.escape("model-00001-of-00002")):
        AutoModelForCausalLM.from_pretrained(folder)


def test_fp8_checkpoints_with_their_config_load_as_before(fp8_dir, tmp_path):
    """hf_fp8's own and a compressed-tensors export (another quantizer's fp8 checkpoint with
    ``weight_scale`` siblings) load; both reproduce the FP8 model's logits."""
    from hf_fp8.serialization import export_checkpoint

    inputs = model_inputs("llama")
    reference = model_output(AutoModelForCausalLM.from_pretrained(fp8_dir), inputs)
    ct = export_checkpoint(fp8_dir, tmp_path / "ct", "compressed-tensors")
    out = model_output(AutoModelForCausalLM.from_pretrained(ct), inputs)
    assert ((out - reference).norm() / reference.norm()).item() < 0.02


def test_plain_checkpoints_and_fp8_without_scales_load(tiny_model_dir, tmp_path):
    """No scale sibling, no refusal: a high-precision folder, and one whose weights are fp8
    values without scales (a plain cast, which is what the model's dtype says)."""
    src = Path(tiny_model_dir("llama"))
    assert AutoModelForCausalLM.from_pretrained(src) is not None
    folder = tmp_path / "cast"
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    key = f"{LAYER}.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(model.get_submodule(LAYER).weight, tensors[key].float())


def test_a_failing_check_disables_itself_and_the_load_goes_on(fp8_dir, tmp_path, monkeypatch):
    from hf_fp8.patches import fp8_without_config
    from hf_fp8.quantizer import lost_config

    def broken(*args, **kwargs):
        raise AttributeError("safe_open has no get_slice")  # an API mismatch

    monkeypatch.setattr(lost_config, "check_fp8_has_config", broken)
    monkeypatch.setattr(fp8_without_config, "_FAILED", [])
    monkeypatch.setattr(patches, "_STATUS", {})
    folder = _without_config(fp8_dir, tmp_path / "ckpt")
    with pytest.warns(patches.PatchWarning, match="no get_slice"):
        AutoModelForCausalLM.from_pretrained(folder)  # loads, as transformers alone would
    assert patches.status()["fp8_without_config"].startswith("off")


@pytest.mark.parametrize("error", [OSError("disk on fire"), RecursionError("deep")])
def test_an_unreadable_file_leaves_the_check_on(fp8_dir, tmp_path, monkeypatch, error):
    """R3 finding 3: a file the check cannot read skips that load's check only."""
    from hf_fp8.patches import fp8_without_config
    from hf_fp8.quantizer import lost_config

    real = lost_config.check_fp8_has_config

    def unreadable(*args, **kwargs):
        raise error

    monkeypatch.setattr(fp8_without_config, "_FAILED", [])
    monkeypatch.setattr(patches, "_STATUS", {})
    folder = _without_config(fp8_dir, tmp_path / "ckpt")
    monkeypatch.setattr(lost_config, "check_fp8_has_config", unreadable)
    AutoModelForCausalLM.from_pretrained(folder)  # unchecked, as transformers alone
    assert patches.status()["fp8_without_config"] == "on"
    monkeypatch.setattr(lost_config, "check_fp8_has_config", real)
    with pytest.raises(CheckpointTensorError):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_quant_method_transformers_does_not_know_is_checked(fp8_dir, tmp_path):
    """R3 finding 6: with an unknown ``quant_method`` transformers skips quantization but
    keeps ``config.quantization_config``; the check took that for "has a config"."""
    folder = tmp_path / "modelopt"
    shutil.copytree(fp8_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointTensorError, match=r"quant_method='modelopt'") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "does not know" in str(err.value)


def test_quantization_config_none_is_named_in_the_refusal(fp8_dir):
    """R3 finding 6: ``quantization_config=None`` is refused; the message named only config=."""
    with pytest.raises(CheckpointTensorError, match=r"quantization_config=None"):
        AutoModelForCausalLM.from_pretrained(fp8_dir, quantization_config=None)
