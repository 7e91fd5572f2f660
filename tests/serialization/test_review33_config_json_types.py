"""Reviewer R33 F7: wrong JSON types in a compressed-tensors ``quantization_config`` gave a raw
``AttributeError`` (the CLI printed "'list' object has no attribute 'items'"): ``config_groups``
a list, a group a string, ``weights`` a list, ``input_activations`` a string, the whole
``quantization_config`` a list. ``symmetric: "false"`` (a string, which the compressed-tensors
library reads as ``False``: asymmetric) imported as symmetric, and ``kv_cache_scheme: {}``
(which the library reads as an int8 KV-cache scheme) imported. Each is refused with a
``ValueError`` naming the field and the type expected; nothing is written."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from pydantic import ValidationError

from hf_fp8.serialization import export_checkpoint, import_checkpoint
from hf_fp8.serialization.checkpoint import Checkpoint
from hf_fp8.serialization.summary import summarize
from tests.serialization.helpers import quantized


@pytest.fixture(scope="module")
def export(tiny_model_dir, tmp_path_factory):
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_checkpoint(model, tmp_path_factory.mktemp("ct") / "out", "compressed-tensors")


def _group(qc):
    return qc["config_groups"]["group_0"]


# (edit of quantization_config, the field the error must name, the type it must name)
CASES = {
    "config_groups a list": (
        lambda qc: qc.update(config_groups=[_group(qc)]),
        "config_groups",
        "object",
    ),
    "group a string": (
        lambda qc: qc["config_groups"].update(group_0="FP8_DYNAMIC"),
        "config_groups.group_0",
        "object",
    ),
    "weights a list": (
        lambda qc: _group(qc).update(weights=[1]),
        "config_groups.group_0.weights",
        "object",
    ),
    "input_activations a string": (
        lambda qc: _group(qc).update(input_activations="dynamic"),
        "config_groups.group_0.input_activations",
        "object",
    ),
    "weights.symmetric a string": (
        lambda qc: _group(qc)["weights"].update(symmetric="false"),
        "config_groups.group_0.weights.symmetric",
        "true or false",
    ),
    "input_activations.dynamic a string": (
        lambda qc: _group(qc)["input_activations"].update(dynamic="true"),
        "config_groups.group_0.input_activations.dynamic",
        "true or false",
    ),
    "weights.dynamic a string": (
        lambda qc: _group(qc)["weights"].update(dynamic="false"),
        "config_groups.group_0.weights.dynamic",
        "true or false",
    ),
    "weights.strategy a list": (
        lambda qc: _group(qc)["weights"].update(strategy=["channel"]),
        "config_groups.group_0.weights.strategy",
        "string",
    ),
}


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_json_types_are_refused_naming_the_field(export, tmp_path, case):
    edit, field, expected = CASES[case]
    config = json.loads((export / "config.json").read_text())
    edit(config["quantization_config"])
    # the reference library refuses the same config, or reads it as something else
    if case.endswith("symmetric a string"):
        args = _group(config["quantization_config"])["weights"]
        assert QuantizationArgs.model_validate(args).symmetric is False  # asymmetric
    elif "dynamic a string" not in case:
        with pytest.raises(ValidationError):
            QuantizationConfig.model_validate(config["quantization_config"])
    src = _edited(export, tmp_path / "src", lambda c: edit(c["quantization_config"]))
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        import_checkpoint(src, out)
    message = str(err.value)
    assert f"quantization_config.{field} " in message, message
    assert expected in message, message
    assert not out.exists()


def test_quantization_config_a_list_is_refused(export, tmp_path):
    def edit(config):
        config["quantization_config"] = [config["quantization_config"]]

    src = _edited(export, tmp_path / "src", edit)
    with pytest.raises(ValueError, match=r"quantization_config is a list.*object") as err:
        import_checkpoint(src, tmp_path / "out")
    assert "config.json" in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"quantization_config is a list"):
        summarize(Checkpoint(src))  # hf-fp8 inspect


@pytest.mark.parametrize("scheme", [{}, {"num_bits": 8, "type": "float"}])
def test_any_kv_cache_scheme_is_refused(export, tmp_path, scheme):
    config = json.loads((export / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] is None  # what the export writes imports
    reference = QuantizationConfig.model_validate({**config, "kv_cache_scheme": scheme})
    assert reference.kv_cache_scheme is not None  # the library quantizes the KV cache
    src = _edited(
        export, tmp_path / "src", lambda c: c["quantization_config"].update(kv_cache_scheme=scheme)
    )
    with pytest.raises(ValueError, match="KV cache"):
        import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_export_itself_imports(export, tmp_path):
    out = import_checkpoint(export, tmp_path / "out")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["activation_scheme"], qc["weight_granularity"]) == ("dynamic", "row")
