"""Reviewer R22 F6: the importers rounded or converted sizes of the wrong type instead of
refusing them: compressed-tensors ``group_size: true`` imported as a block [128, 1], 32.9 and
"32" as 32; vLLM ``weight_block_size`` [32.9, 32.9] and ["32", "32"] as [32, 32]. A size
must be an int (not a bool); the error names the field and config.json, nothing is written."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from hf_fp8.serialization import export_checkpoint, import_checkpoint
from tests.serialization.helpers import quantized


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    """compressed-tensors export with group activations (group_size 32), vLLM block export."""
    out = {}
    for scheme, fmt in (("dynamic-row-block", "compressed-tensors"), ("dynamic-block", "vllm-fp8")):
        model = quantized(tiny_model_dir("llama"), scheme)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[fmt] = export_checkpoint(model, tmp_path_factory.mktemp(fmt) / "out", fmt)
    return out


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _names(field: str) -> str:
    """A message naming ``field`` and config.json, in any order."""
    return rf"(?s)^(?=.*{field})(?=.*config\.json)"


def _group(qc):
    return qc["config_groups"]["group_0"]


@pytest.mark.parametrize("bad", [True, 32.9, "32", 32.0, None])
def test_compressed_tensors_group_size_must_be_an_int(exports, tmp_path, bad):
    src = exports["compressed-tensors"]
    assert (
        _group(json.loads((src / "config.json").read_text())["quantization_config"])[
            "input_activations"
        ]["group_size"]
        == 32
    )

    def edit(qc):
        _group(qc)["input_activations"]["group_size"] = bad

    path = _edited(src, tmp_path / "src", edit)
    with pytest.raises(ValueError, match=_names("group_size")):
        import_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [[32, 32.9], [True, 32]])
def test_compressed_tensors_block_structure_must_be_ints(exports, tmp_path, bad):
    def edit(qc):
        _group(qc)["weights"]["strategy"] = "block"
        _group(qc)["weights"]["block_structure"] = bad

    path = _edited(exports["compressed-tensors"], tmp_path / "src", edit)
    with pytest.raises(ValueError, match=_names("block_structure")):
        import_checkpoint(path, tmp_path / "out")


@pytest.mark.parametrize("bad", [[32.9, 32.9], ["32", "32"], [32.0, 32], [True, 32], 32, [32]])
def test_vllm_weight_block_size_must_be_two_ints(exports, tmp_path, bad):
    src = exports["vllm-fp8"]
    assert json.loads((src / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ] == [32, 32]

    def edit(qc):
        qc["weight_block_size"] = bad

    path = _edited(src, tmp_path / "src", edit)
    with pytest.raises(ValueError, match=_names("weight_block_size")):
        import_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_int_sizes_still_import(exports, tmp_path):
    """Control: the exports as written import with their sizes."""
    # the model's block size: compressed-tensors keeps it in hf_fp8_block_size (HF38)
    for fmt, block in (("compressed-tensors", [32, 32]), ("vllm-fp8", [32, 32])):
        out = import_checkpoint(exports[fmt], tmp_path / fmt)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["block_size"] == block
