"""Every unsupported input fails with a ValueError that names what is wrong and the fix."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.serialization import export_checkpoint, import_checkpoint
from tests.serialization.helpers import quantized


@pytest.fixture(scope="module")
def ct_dir(tiny_model_dir, tmp_path_factory):
    """A valid compressed-tensors export (dynamic, per-channel) to break in each test."""
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    return export_checkpoint(model, tmp_path_factory.mktemp("ct") / "ct")


def _with_config(src, dst, edit):
    """Copy ``src`` to ``dst`` with its quantization_config edited by ``edit(qc)``."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _group(qc):
    return qc["config_groups"]["group_0"]


INT8 = {"num_bits": 8, "type": "int", "strategy": "channel", "dynamic": False, "symmetric": True}
FP4 = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "dynamic": False,
    "symmetric": True,
}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda qc: _group(qc).update(weights=INT8), "int with 8 bits"),
        (
            lambda qc: _group(qc).update(weights=FP4, format="nvfp4-pack-quantized"),
            "float with 4 bits",
        ),
        (lambda qc: _group(qc)["weights"].update(symmetric=False), "asymmetric"),
        (
            lambda qc: _group(qc)["input_activations"].update(
                strategy="group", group_size=16, dynamic=False
            ),
            "'group' with dynamic=False",
        ),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV cache"),
        (lambda qc: qc.update(quantization_status="frozen"), "not stored in fp8"),
        (
            lambda qc: qc["config_groups"].update(
                group_1={**_group(qc), "weights": {**_group(qc)["weights"], "strategy": "tensor"}}
            ),
            "different FP8 schemes",
        ),
    ],
)
def test_unsupported_compressed_tensors_variants(edit, message, ct_dir, tmp_path):
    src = _with_config(ct_dir, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message) as err:
        import_checkpoint(src, tmp_path / "out")
    assert "hf_fp8 imports FP8" in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing written on failure


def test_fp8_output_layer_is_imported_and_reloads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_fp8 import Fp8Linear
    from tests.serialization.ct_reference import make_ct_checkpoint

    made = tmp_path / "all-fp8"
    make_ct_checkpoint(tiny_model_dir("llama"), made, "FP8_DYNAMIC", ignore=())
    import_checkpoint(made, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert isinstance(model.lm_head, Fp8Linear)  # the saved (empty) skip list is honoured


def test_unknown_quant_method(ct_dir, tmp_path):
    src = _with_config(
        ct_dir, tmp_path / "bad", lambda qc: (qc.clear(), qc.update(quant_method="awq"))
    )
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        import_checkpoint(src, tmp_path / "out")


def test_import_of_hf_fp8_or_unquantized(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="not quantized"):
        import_checkpoint(tiny_model_dir("llama"), tmp_path / "a")
    fp8 = tmp_path / "fp8"
    quantized(tiny_model_dir("llama"), "dynamic-row-token").save_pretrained(fp8)
    with pytest.raises(ValueError, match="already an hf_fp8 checkpoint"):
        import_checkpoint(fp8, tmp_path / "b")


def test_export_refusals(tiny_model_dir, ct_dir, tmp_path):
    with pytest.raises(ValueError, match="not quantized"):
        export_checkpoint(tiny_model_dir("llama"), tmp_path / "a")
    with pytest.raises(ValueError, match="compressed-tensors checkpoint, not hf_fp8"):
        export_checkpoint(ct_dir, tmp_path / "b")
    with pytest.raises(ValueError, match="format='int4' is not supported"):
        export_checkpoint(ct_dir, tmp_path / "c", "int4")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="not an hf_fp8 model"):
        export_checkpoint(plain, tmp_path / "d")


def test_e5m2_has_no_compressed_tensors_form(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic", fp8_format="e5m2")
    )
    with pytest.raises(ValueError, match="e4m3 only"):
        export_checkpoint(model, tmp_path / "ct")


def test_gpt2_conv1d_stays_in_hf_fp8_format(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gpt2"), quantization_config=Fp8Config("dynamic")
    )
    with pytest.raises(ValueError, match="Conv1D"):
        export_checkpoint(model, tmp_path / "ct")


def test_uncalibrated_static_model_is_refused(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )
    with pytest.raises(ValueError, match="calibrate"):
        export_checkpoint(model, tmp_path / "ct")


def test_group_activations_need_divisible_layers(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"),
        quantization_config=Fp8Config(
            "dynamic", activation_granularity="block", block_size=[128, 48]
        ),
    )
    with pytest.raises(ValueError, match="divisible by 48"):
        export_checkpoint(model, tmp_path / "ct")


def test_output_folder_rules(ct_dir, tiny_model_dir, tmp_path):
    fp8 = tmp_path / "fp8"
    quantized(tiny_model_dir("llama"), "dynamic-row-token").save_pretrained(fp8)
    with pytest.raises(ValueError, match="is the source folder"):
        export_checkpoint(fp8, fp8)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        hf_fp8.export(fp8, busy)
    hf_fp8.export(fp8, busy, overwrite=True)
    assert (busy / "notes.txt").read_text() == "mine"
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a Hub repo id"):
        export_checkpoint("no such/folder/here", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        export_checkpoint(busy / "..", tmp_path / "y")
