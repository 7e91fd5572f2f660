"""Reviewer R33 F1: an FP8 KV-cache checkpoint imported silently and lost its KV-cache
quantization. A vLLM ``fp8`` config with ``kv_cache_scheme: "static"`` and
``self_attn.k_scale`` / ``v_scale`` tensors (or a compressed-tensors checkpoint holding those
tensors with ``kv_cache_scheme: null``) imported; the scales became stray keys (UNEXPECTED at
load) and the model ran with a high-precision KV cache. hf_fp8 does not quantize the KV cache:
such a checkpoint is refused (config key or tensor), naming the FP8 KV cache and the fix, and
nothing is written. ``k_proj.output_scale`` (AutoFP8's old KV scale) said "packed, grouped or
global scales"; it names the KV cache now."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from compressed_tensors.quantization.quant_metadata import KVCacheScaleType
from safetensors.torch import load_file, save_file

from hf_fp8.serialization import export_checkpoint, import_checkpoint
from tests.serialization.helpers import quantized

# What the reference library (compressed-tensors) names KV-cache / attention scales, and
# AutoFP8's older per-projection KV scale
KV_LEAVES = sorted({t.value for t in KVCacheScaleType})
FORMATS = ("vllm-fp8", "compressed-tensors")


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    model = quantized(tiny_model_dir("llama"), "static-tensor")
    out = {}
    for fmt in FORMATS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[fmt] = export_checkpoint(model, tmp_path_factory.mktemp(fmt) / "out", fmt)
    return out


def _edited(src, dst, tensors=None, qc=None):
    shutil.copytree(src, dst)
    if tensors:
        state = load_file(dst / "model.safetensors")
        assert not set(tensors) & set(state)
        state.update(tensors)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    if qc:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"].update(qc)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _kv_tensors(leaves=("k_scale", "v_scale"), module="self_attn"):
    return {
        f"model.layers.{i}.{module}.{leaf}": torch.tensor(0.05) for i in range(2) for leaf in leaves
    }


def _refused(src, out, *fields):
    with pytest.raises(ValueError) as err:
        import_checkpoint(src, out)
    message = str(err.value)
    assert "KV cache" in message, message
    assert "high-precision KV cache" in message, message  # the fix, and what it costs
    for field in fields:
        assert field in message, message
    assert "packed, grouped" not in message
    assert not out.exists()  # nothing written
    return message


def test_vllm_fp8_kv_cache_scheme_with_scales_is_refused(exports, tmp_path):
    src = _edited(
        exports["vllm-fp8"], tmp_path / "src", _kv_tensors(), {"kv_cache_scheme": "static"}
    )
    message = _refused(src, tmp_path / "out", "kv_cache_scheme")
    assert "k_scale" in message or "kv_cache_scheme" in message, message


@pytest.mark.parametrize(
    "qc", [{"kv_cache_scheme": "static"}, {"kv_cache_quant_method": "fp8"}], ids=str
)
def test_vllm_fp8_kv_cache_config_alone_is_refused(exports, tmp_path, qc):
    src = _edited(exports["vllm-fp8"], tmp_path / "src", qc=qc)
    message = _refused(src, tmp_path / "out", *qc)
    assert all(key in message for key in qc), message


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("leaf", KV_LEAVES)
def test_kv_scale_tensors_are_refused(exports, tmp_path, fmt, leaf):
    # compressed-tensors: kv_cache_scheme stays null (the export writes it), as in R33's case
    config = json.loads((exports[fmt] / "config.json").read_text())["quantization_config"]
    assert not config.get("kv_cache_scheme")
    src = _edited(exports[fmt], tmp_path / "src", _kv_tensors((leaf,)))
    _refused(src, tmp_path / "out", f"self_attn.{leaf}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("proj", ["k_proj", "v_proj"])
def test_projection_output_scale_names_the_kv_cache(exports, tmp_path, fmt, proj):
    """AutoFP8's older spelling: ``k_proj.output_scale`` on an FP8 layer."""
    src = _edited(
        exports[fmt], tmp_path / "src", _kv_tensors(("output_scale",), f"self_attn.{proj}")
    )
    message = _refused(src, tmp_path / "out", f"{proj}.output_scale")
    assert f"{proj}.output_scale" in message, message


@pytest.mark.parametrize("fmt", FORMATS)
def test_clean_export_still_imports(exports, tmp_path, fmt):
    out = import_checkpoint(exports[fmt], tmp_path / "out")
    state = load_file(out / "model.safetensors")
    assert not [k for k in state if k.rpartition(".")[2] in (*KV_LEAVES, "output_scale")]
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["activation_scheme"]
        == "static"
    )
