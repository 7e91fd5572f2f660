"""Config mistakes at load time get an error that says what to change (reviewer R2 minors).

* ``Fp8Config(dequantize=True)`` with a high-precision checkpoint (on-the-fly) was silently
  ignored: the model came back FP8.
* A ``config.json`` whose ``modules_to_not_convert`` lost ``lm_head`` failed on
  ``lm_head.weight`` not being fp8, without saying to put ``lm_head`` back in the list.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError


@pytest.fixture(scope="module")
def fp8_dir(llama_fp8_dir) -> Path:
    return llama_fp8_dir


def test_on_the_fly_dequantize_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"dequantize=True.*FP8 checkpoint") as err:
        AutoModelForCausalLM.from_pretrained(
            tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic", dequantize=True)
        )
    assert "without quantization_config" in str(err.value)


def test_dequantize_of_an_fp8_folder_that_lost_its_config_says_to_restore_it(fp8_dir, tmp_path):
    """The folder may be FP8 whose config.json lost its quantization_config (reviewer R3 9):
    the refusal said "this checkpoint is not FP8"."""
    folder = tmp_path / "m"
    shutil.copytree(fp8_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"dequantize=True") as err:
        AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=Fp8Config("dynamic", dequantize=True)
        )
    message = str(err.value)
    assert "is not FP8" not in message
    assert "config.json has no quantization_config" in message
    assert "restore" in message


def _skip_list(fp8_dir: Path, dst: Path, skip: list[str]) -> Path:
    shutil.copytree(fp8_dir, dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head"]
    config["quantization_config"]["modules_to_not_convert"] = skip
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("skip", [[], ["q_proj"]])
def test_lm_head_dropped_from_the_skip_list_names_the_fix(fp8_dir, tmp_path, skip):
    folder = _skip_list(fp8_dir, tmp_path / "ckpt", skip)
    with pytest.raises(CheckpointTensorError, match=r"^lm_head\.weight: ") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    message = str(err.value)
    assert "no lm_head.weight_scale" in message
    assert f"modules_to_not_convert ({skip})" in message and "add 'lm_head'" in message
