"""Reviewer R22 F4: inspect, export and import built the whole model config.json describes on
the meta device: a 120 KB folder whose config says num_hidden_layers=20000 took 170 s and
1.1 GB. A config that describes far more layers than the tensors hold is refused before
anything is built, naming the field, both counts and the fix (inspect: as its note)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint
from hf_fp8.serialization.layers import check_layer_counts
from tests.serialization.helpers import quantized

HUGE = 10**7  # building this many layers would take days


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    """The tiny llama's hf_fp8 checkpoint and its vLLM export (2 layers each)."""
    root = tmp_path_factory.mktemp("counts")
    model = quantized(tiny_model_dir("llama"), "dynamic-tensor-token")
    model.save_pretrained(root / "hf_fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_checkpoint(root / "hf_fp8", root / "vllm", "vllm-fp8")
    return root


def _with_layers(src, dst, count, key="num_hidden_layers"):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    config[key] = count
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["hf_fp8", "vllm"])
def test_inspect_of_a_config_with_huge_layer_count_is_quick(folders, tmp_path, fmt):
    path = _with_layers(folders / fmt, tmp_path / "src", HUGE)
    summary = inspect_checkpoint(path)
    assert summary.note is not None
    assert "num_hidden_layers" in summary.note and str(HUGE) in summary.note
    assert summary.high_precision_layers is None  # not a list of layers the files lack
    assert len(summary.fp8_layers) == 14  # what the headers say is still reported


@pytest.mark.timeout(120)
def test_export_and_import_refuse_it_before_building(folders, tmp_path):
    src = _with_layers(folders / "hf_fp8", tmp_path / "hf", HUGE)
    with pytest.raises(ValueError, match=rf"num_hidden_layers.*{HUGE}.*2"):
        export_checkpoint(src, tmp_path / "exported", "vllm-fp8")
    assert not (tmp_path / "exported").exists()
    src = _with_layers(folders / "vllm", tmp_path / "vllm", HUGE)
    with pytest.raises(ValueError, match=rf"num_hidden_layers.*{HUGE}.*2"):
        import_checkpoint(src, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


@pytest.mark.timeout(120)
def test_a_moderate_excess_is_refused_too(folders, tmp_path):
    """300 layers in config.json, 2 in the files: no phantom high-precision layers listed
    (the old inspect listed 2 084 linears the folder does not have)."""
    path = _with_layers(folders / "hf_fp8", tmp_path / "src", 300)
    summary = inspect_checkpoint(path)
    assert summary.high_precision_layers is None and "num_hidden_layers" in summary.note


def test_a_complete_checkpoint_is_unchanged(folders):
    summary = inspect_checkpoint(folders / "vllm")
    assert summary.note is None and summary.high_precision_layers == ["lm_head"]


def test_nested_and_other_count_fields_are_checked():
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)]
    check_layer_counts({"num_hidden_layers": 4, "text_config": {"num_hidden_layers": 4}}, names)
    for config, field in (
        ({"text_config": {"num_hidden_layers": HUGE}}, "text_config.num_hidden_layers"),
        ({"vision_config": {"num_layers": HUGE}}, "vision_config.num_layers"),
        ({"n_layer": HUGE}, "n_layer"),
        ({"decoder_layers": HUGE, "encoder_layers": 4}, "decoder_layers"),
    ):
        with pytest.raises(ValueError, match=rf"{field} is {HUGE}.*4"):
            check_layer_counts(config, names)
    # a tiny folder cannot make the bound large with one tensor named layers.<huge>
    with pytest.raises(ValueError, match="num_hidden_layers"):
        check_layer_counts({"num_hidden_layers": HUGE}, [f"model.layers.{HUGE - 1}.w"])


def test_shared_layers_are_not_refused():
    """ALBERT runs one stored layer num_hidden_layers (12) times: a small excess is built."""
    names = ["albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight"]
    assert check_layer_counts({"num_hidden_layers": 12, "num_hidden_groups": 1}, names) is None
