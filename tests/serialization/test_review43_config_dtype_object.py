"""R43 F2: transformers 5.24 writes a per-sub-config ``dtype`` as an object of strings
(``PretrainedConfig.dict_dtype_to_str``) and ``from_pretrained`` loads it; the config type
checks of this session (R41 F1) refused it in ``inspect`` / ``export``, which read it at
17292a2. An object whose values are not dtype names is still refused. References: the values
written into config.json here."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from hf_fp8.serialization import export_checkpoint, inspect_checkpoint
from tests.serialization.helpers import quantized


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("r43_dtype")
    quantized(tiny_model_dir("llama"), "dynamic-tensor-token").save_pretrained(root / "fp8")
    return root / "fp8"


def _with_dtype(src, dst, value):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_per_sub_config_dtype_object_is_read(fp8_dir, tmp_path):
    value = {"text_config": "float32", "vision_config": "bfloat16"}
    src = _with_dtype(fp8_dir, tmp_path / "src", value)
    summary = inspect_checkpoint(src)
    assert summary.architecture == "LlamaForCausalLM" and summary.scheme is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_checkpoint(src, tmp_path / "ct", "compressed-tensors")
    assert json.loads((out / "config.json").read_text())["dtype"] == value


@pytest.mark.parametrize("value", [{"text_config": 3}, {"text_config": ["float32"]}])
def test_an_object_of_other_values_is_refused(fp8_dir, tmp_path, value):
    src = _with_dtype(fp8_dir, tmp_path / "src", value)
    with pytest.raises(ValueError) as err:
        inspect_checkpoint(src)
    assert "config.json" in str(err.value) and "dtype" in str(err.value), err.value
