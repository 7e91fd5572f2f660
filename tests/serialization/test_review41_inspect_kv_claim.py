"""Reviewer R41 F3: for an hf_fp8 checkpoint whose ``quantization_config`` holds
``kv_cache_scheme`` (or ``kv_cache_quant_method``), ``hf-fp8 inspect``'s ``kv cache`` row said
"from_pretrained drops them (UNEXPECTED keys) and runs a high-precision KV cache", while
``from_pretrained`` raises ``ValueError`` for the unknown field; and the ``scheme`` row showed
that error instead of the FP8 scheme. The row now says that loading needs the key removed from
config.json's ``quantization_config`` (and that the model then runs a high-precision KV
cache), and the scheme row shows the scheme.

References: the saved model's own ``Fp8Config`` and logits, and what ``from_pretrained`` does
with the folder (refuses it; loads it once the key is removed, scale tensors dropped)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fp8.cli import main
from hf_fp8.serialization import inspect_checkpoint
from tests.serialization.helpers import logits, quantized

KEYS = {"kv_cache_scheme": {"num_bits": 8, "type": "float"}, "kv_cache_quant_method": "fp8"}
KV_SCALES = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.05) for i in range(2)}


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    model = quantized(tiny_model_dir("llama"), "dynamic-tensor-token")
    path = tmp_path_factory.mktemp("r41_kv") / "fp8"
    model.save_pretrained(path)
    return path, model.config.quantization_config, logits(model)


def _with(src, dst, qc, tensors=None):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(qc)
    (dst / "config.json").write_text(json.dumps(config))
    if tensors:
        state = load_file(dst / "model.safetensors")
        state.update(tensors)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _without_key(path, key):
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"][key]
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("key", sorted(KEYS))
@pytest.mark.parametrize("with_scales", [False, True], ids=["key", "key+scales"])
def test_row_says_what_from_pretrained_does(saved, tmp_path, key, with_scales):
    src_model, config, want = saved
    tensors = KV_SCALES if with_scales else None
    src = _with(src_model, tmp_path / "src", {key: KEYS[key]}, tensors)
    summary = inspect_checkpoint(src)
    # the scheme is the saved model's, not the unknown-field error
    assert summary.scheme is not None, summary.note
    for field in ("activation_scheme", "weight_granularity", "activation_granularity"):
        assert summary.scheme[field] == getattr(config, field), field
    assert summary.scheme["fp8_format"] == config.fp8_format
    assert summary.note is None, summary.note
    assert summary.kv_cache_config == {key: KEYS[key]}
    text = summary.kv_cache_text
    assert "UNEXPECTED" not in text or with_scales, text
    assert f"quantization_config.{key}" in text and "remove" in text, text
    assert "from_pretrained refuses" in text, text
    # what the row says: from_pretrained refuses the folder as it is ...
    with pytest.raises(ValueError, match=key):
        AutoModelForCausalLM.from_pretrained(src)
    # ... and loads it, high-precision KV cache, once the key is removed
    _without_key(src, key)
    back = AutoModelForCausalLM.from_pretrained(src)
    assert not set(KV_SCALES) & set(back.state_dict())  # scales dropped, as the row says
    torch.testing.assert_close(logits(back), want, rtol=0, atol=0)


def test_cli_rows(saved, tmp_path, capsys):
    src = _with(saved[0], tmp_path / "src", {"kv_cache_scheme": KEYS["kv_cache_scheme"]}, KV_SCALES)
    assert main(["inspect", str(src)]) == 0
    rows = capsys.readouterr().out.splitlines()
    scheme = [r for r in rows if r.startswith("scheme")]
    assert scheme == [
        "scheme          dynamic: e4m3 weights per tensor, activations e4m3 per token "
        "(dynamic scales)"
    ], rows
    kv = [r for r in rows if r.startswith("kv cache")]
    assert len(kv) == 1 and "from_pretrained refuses" in kv[0], kv
    assert not [r for r in rows if r.startswith("note")], rows
