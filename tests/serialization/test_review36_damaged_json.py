"""R36: a config.json that is not a JSON object, or config.json / the shard index nested past
Python's recursion limit, gave raw AttributeError / RecursionError from import and inspect;
now a ValueError names the file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_fp8.serialization import summary
from hf_fp8.serialization.importer import import_checkpoint

DEEP = "[" * 100_000 + "]" * 100_000
FP8 = {"model_type": "llama", "quantization_config": {"quant_method": "fp8"}}


def _folder(tmp_path, config_text: str, index_text: str | None = None):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text(config_text)
    if index_text is None:
        save_file({"a.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    else:
        save_file({"a.weight": torch.zeros(2, 2)}, str(folder / "s1.safetensors"))
        (folder / "model.safetensors.index.json").write_text(index_text)
    return folder


CASES = {
    "config is a list": ("[1, 2]", None, r"config\.json holds a list, not a JSON object"),
    "config is a string": ('"x"', None, r"config\.json holds a str"),
    "config nested deep": (DEEP, None, r"config\.json in .*nested too deeply"),
    "quantization_config nested deep": (
        '{"quantization_config": ' + DEEP + "}",
        None,
        r"config\.json in .*nested too deeply",
    ),
    "quantization_config is a list": (
        '{"model_type": "llama", "quantization_config": [1]}',
        None,
        r"quantization_config is a list",
    ),
    "index nested deep": (json.dumps(FP8), DEEP, r"index\.json in .*nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("entry", ["import", "summary"])
def test_damaged_json_is_a_value_error_naming_the_file(tmp_path, case, entry):
    config_text, index_text, pattern = CASES[case]
    folder = _folder(tmp_path, config_text, index_text)
    with pytest.raises(ValueError, match=pattern):
        if entry == "import":
            import_checkpoint(folder, tmp_path / "out")
        else:
            summary.summarize(summary.Checkpoint(folder))
    assert not (tmp_path / "out").exists()
