"""Known gap 2 (thirteenth session): ``hf-fp8 inspect`` said nothing about the KV-cache /
attention scale tensors of a checkpoint (vLLM's and compressed-tensors' ``k_scale``,
``v_scale``, ``q_scale``, ``prob_scale``, AutoFP8's ``kv_scale`` and ``k_proj.output_scale``):
they were counted as "norms and other 1-D tensors" among the parameters, and a
``kv_cache_scheme`` in the config hid the FP8 scheme behind a note. ``inspect`` now lists
them (text and ``--json``), with the config keys, and says that hf_fp8 does not apply them
(``hf-fp8 import`` refuses such a checkpoint). Reference: the tensors written into the
checkpoint here, read back with safetensors."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fp8.cli import main
from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint
from tests.serialization.helpers import quantized

FORMATS = ("vllm-fp8", "compressed-tensors")
# compressed-tensors' KVCacheScaleType values and AutoFP8's names (hf_fp8.serialization.tensors
# refuses the same at import)
KV_LEAVES = ("k_scale", "v_scale", "q_scale", "prob_scale", "kv_scale")
_SCALE_LEAVES = ("weight_scale", "weight_scale_inv", "input_scale")


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    model = quantized(tiny_model_dir("llama"), "static-tensor")
    out = {}
    for fmt in FORMATS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[fmt] = export_checkpoint(model, tmp_path_factory.mktemp(fmt) / "out", fmt)
    return out


def _with_kv(src, dst, tensors, qc=None):
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    assert not set(tensors) & set(state)
    state.update(tensors)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    if qc:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"].update(qc)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _kv(leaves=("k_scale", "v_scale"), module="self_attn") -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.{module}.{leaf}": torch.tensor(0.05) for i in range(2) for leaf in leaves
    }


def _file_counts(path) -> tuple[int, int]:
    """(parameters, scale bytes) read from the file: every tensor but scales is a parameter;
    weight / input scales and the KV-cache scales are scales."""
    params = scale_bytes = 0
    kv = (*KV_LEAVES, "output_scale")
    with safe_open(path / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118
            t = f.get_tensor(key)
            if key.rpartition(".")[2] in (*_SCALE_LEAVES, *kv):
                scale_bytes += t.numel() * t.element_size()
            else:
                params += t.numel()
    return params, scale_bytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_inspect_lists_kv_cache_scales(exports, tmp_path, fmt):
    written = _kv(KV_LEAVES)
    src = _with_kv(exports[fmt], tmp_path / "src", written)
    summary = inspect_checkpoint(src)
    assert summary.kv_cache_scales == sorted(written)
    assert summary.scheme is not None and summary.scheme["activation_scheme"] == "static"
    text = summary.kv_cache_text
    assert "does not apply" in text and "import" in text, text
    params, scale_bytes = _file_counts(src)
    assert summary.parameters == params  # the KV scales are not parameters
    assert summary.scale_bytes == scale_bytes
    as_json = json.loads(json.dumps(summary.to_dict()))
    assert as_json["kv_cache_scales"] == sorted(written)
    assert as_json["kv_cache_text"] == text
    with pytest.raises(ValueError, match="KV cache"):  # what the text says import does
        import_checkpoint(src, tmp_path / "imported")


@pytest.mark.parametrize("fmt", FORMATS)
def test_projection_output_scale_is_listed(exports, tmp_path, fmt):
    """AutoFP8's per-projection KV scale sits on an FP8 linear (k_proj / v_proj)."""
    written = {
        **_kv(("output_scale",), "self_attn.k_proj"),
        **_kv(("output_scale",), "self_attn.v_proj"),
    }
    src = _with_kv(exports[fmt], tmp_path / "src", written)
    summary = inspect_checkpoint(src)
    assert summary.kv_cache_scales == sorted(written)
    assert (summary.parameters, summary.scale_bytes) == _file_counts(src)


def test_kv_cache_scheme_is_reported_with_the_fp8_scheme(exports, tmp_path):
    src = _with_kv(exports["vllm-fp8"], tmp_path / "src", _kv(), {"kv_cache_scheme": "static"})
    summary = inspect_checkpoint(src)
    assert summary.kv_cache_config == {"kv_cache_scheme": "static"}
    assert summary.scheme is not None  # not hidden behind the KV-cache refusal
    assert "static: e4m3 weights per tensor" in summary.scheme_text
    assert "kv_cache_scheme" in summary.kv_cache_text


def test_clean_checkpoint_reports_no_kv_cache(exports):
    summary = inspect_checkpoint(exports["compressed-tensors"])
    assert summary.kv_cache_scales == [] and summary.kv_cache_config == {}
    assert summary.kv_cache_text is None


def test_cli_text_and_json(exports, tmp_path, capsys):
    written = _kv()
    src = _with_kv(exports["vllm-fp8"], tmp_path / "src", written)
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("kv cache")]
    assert len(rows) == 1, out
    assert "4 " in rows[0] and "k_scale" in rows[0] and "v_scale" in rows[0], rows[0]
    assert "does not apply" in rows[0], rows[0]
    assert main(["inspect", str(src), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_cache_scales"] == sorted(written)
    assert main(["inspect", str(exports["vllm-fp8"])]) == 0
    assert "kv cache" not in capsys.readouterr().out  # nothing to report


def test_hf_fp8_checkpoint_with_kv_scales_says_what_from_pretrained_does(tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    model.save_pretrained(tmp_path / "fp8")
    written = _kv(("k_scale",))
    src = _with_kv(tmp_path / "fp8", tmp_path / "src", written)
    summary = inspect_checkpoint(src)
    assert summary.format == "hf_fp8" and summary.kv_cache_scales == sorted(written)
    assert "from_pretrained drops them" in summary.kv_cache_text, summary.kv_cache_text
    back = AutoModelForCausalLM.from_pretrained(src)  # what the text says: dropped
    assert not set(written) & set(back.state_dict())
