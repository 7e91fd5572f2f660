"""HF32 leftover (after R41): the compressed-tensors round trip of non-block weights with
dynamic ``1 × k`` activation groups came back with ``block_size [128, k]`` instead of the
model's ``[rows, k]`` (the format stores only ``group_size = k``; weight ``block_structure`` is
for block weights only), so ``hf-fp8 import`` gave another ``Fp8Config`` than the exported
model's. The export now records the model's block size in
``quantization_config.hf_fp8_block_size`` (as the vllm-fp8 export does; compressed-tensors,
transformers and vLLM ignore unknown top-level keys) and the import reads it back. An export
without the key (earlier hf_fp8) still imports with ``[128, k]``; a key that disagrees with
``group_size`` or is not two ints is refused, naming it.

References: the exported model's own ``Fp8Config`` and logits, stock transformers' load of the
export (compressed-tensors' own reader)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint
from tests.serialization.helpers import fp32_close, logits, stock_load

FIELDS = ("activation_scheme", "weight_granularity", "activation_granularity", "block_size")
RECIPES = {
    "tensor-32x32": dict(weight_granularity="tensor", block_size=[32, 32]),
    "tensor-64x16": dict(weight_granularity="tensor", block_size=[64, 16]),
    "row-32x32": dict(weight_granularity="row", block_size=[32, 32]),
}


def _model(path: str, recipe: str):
    config = Fp8Config("dynamic", activation_granularity="block", **RECIPES[recipe])
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config
    )


def _export(model, out):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM serves groups on non-block weights per token
        return export_checkpoint(model, out, "compressed-tensors")


def _qc(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_round_trip_gives_the_same_config_and_logits(tiny_model_dir, tmp_path, recipe):
    model = _model(tiny_model_dir("llama"), recipe)
    want_config = model.config.quantization_config
    want = logits(model)
    ct = _export(model, tmp_path / "ct")
    QuantizationConfig.model_validate(_qc(ct))  # compressed-tensors accepts the config
    fp32_close(logits(stock_load(ct)), want)  # and transformers still loads the export

    back_dir = import_checkpoint(ct, tmp_path / "back")
    qc = _qc(back_dir)
    for field in FIELDS:
        assert qc[field] == getattr(want_config, field), (field, qc[field])
    summary = inspect_checkpoint(ct)  # inspect reads the export the same way
    assert summary.scheme["block_size"] == list(want_config.block_size)
    back = AutoModelForCausalLM.from_pretrained(back_dir)
    for field in FIELDS:
        assert getattr(back.config.quantization_config, field) == getattr(want_config, field)
    torch.testing.assert_close(logits(back), want, rtol=0, atol=0)


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_earlier_export_without_the_key_imports_with_128_rows(tiny_model_dir, tmp_path):
    model = _model(tiny_model_dir("llama"), "tensor-32x32")
    ct = _export(model, tmp_path / "ct")
    old = _edited(ct, tmp_path / "old", lambda qc: qc.pop("hf_fp8_block_size", None))
    qc = _qc(import_checkpoint(old, tmp_path / "back"))
    assert qc["block_size"] == [128, 32] and qc["activation_granularity"] == "block"


@pytest.mark.parametrize("bad", [[32, 16], [32], "32", [32.0, 32], [True, 32], {"rows": 32}])
def test_damaged_key_is_refused(tiny_model_dir, tmp_path, bad):
    model = _model(tiny_model_dir("llama"), "tensor-32x32")
    ct = _export(model, tmp_path / "ct")
    assert _qc(ct)["hf_fp8_block_size"] == [32, 32]

    def edit(qc):
        qc["hf_fp8_block_size"] = bad

    src = _edited(ct, tmp_path / "src", edit)
    with pytest.raises(
        ValueError, match=r"(?s)hf_fp8_block_size.*config\.json|config\.json.*hf_fp8_block_size"
    ):
        import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_key_on_other_schemes_is_refused(tiny_model_dir, tmp_path):
    """The key goes with group activations on non-block weights only."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )
    ct = _export(model, tmp_path / "ct")
    assert "hf_fp8_block_size" not in _qc(ct)  # per-token activations: nothing to record

    def edit(qc):
        qc["hf_fp8_block_size"] = [32, 32]

    src = _edited(ct, tmp_path / "src", edit)
    with pytest.raises(ValueError, match="hf_fp8_block_size"):
        import_checkpoint(src, tmp_path / "out")
