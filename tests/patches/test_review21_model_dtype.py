"""R21 F1: ``model.dtype`` of an hf_fp8 model is its compute dtype, never fp8.

transformers' ``dtype`` is the first floating parameter; when that is an FP8 weight
(PatchTST, BLT, BridgeTower, Granite Speech, ...) ``save_pretrained`` wrote
``"dtype": "float8_e4m3fn"`` to config.json and the reload was refused.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config, Fp8Linear


def _patchtst(folder, dtype=None):
    torch.manual_seed(0)
    cfg = tf.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=64,
        num_hidden_layers=1, num_attention_heads=4, ffn_dim=128,
    )  # fmt: skip
    model = tf.PatchTSTModel(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    return tf.PatchTSTModel.from_pretrained(
        folder, quantization_config=Fp8Config("dynamic"), **({"dtype": dtype} if dtype else {})
    ).eval()


def _inputs(dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(2, 32, 3, dtype=dtype)


def _first_floating(model):
    return next(p for p in model.parameters() if p.is_floating_point())


def test_patchtst_dtype_is_compute_dtype_and_reloads_exact(tmp_path):
    q = _patchtst(tmp_path / "hp")
    assert _first_floating(q).dtype == torch.float8_e4m3fn  # the case of the finding
    assert q.dtype == torch.float32
    with torch.no_grad():
        ref = q(past_values=_inputs()).last_hidden_state
    q.save_pretrained(tmp_path / "fp8")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["dtype"] == "float32"
    back = tf.PatchTSTModel.from_pretrained(tmp_path / "fp8").eval()
    assert back.dtype == torch.float32
    with torch.no_grad():
        out = back(past_values=_inputs()).last_hidden_state
    assert out.dtype == torch.float32
    assert torch.equal(out, ref)


def test_patchtst_bf16_keeps_bfloat16(tmp_path):
    q = _patchtst(tmp_path / "hp", torch.bfloat16)
    assert q.dtype == torch.bfloat16
    q.save_pretrained(tmp_path / "fp8")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["dtype"] == "bfloat16"
    back = tf.PatchTSTModel.from_pretrained(tmp_path / "fp8").eval()
    assert back.dtype == torch.bfloat16
    with torch.no_grad():
        x = _inputs(torch.bfloat16)
        assert torch.equal(
            back(past_values=x).last_hidden_state, q(past_values=x).last_hidden_state
        )
    # .to() changes the compute dtype, and dtype follows it
    assert q.to(torch.float16).dtype == torch.float16


def test_old_checkpoint_with_fp8_config_dtype_loads(tmp_path):
    q = _patchtst(tmp_path / "hp")
    with torch.no_grad():
        ref = q(past_values=_inputs()).last_hidden_state
    q.save_pretrained(tmp_path / "fp8")
    path = tmp_path / "fp8" / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = "float8_e4m3fn"  # what hf_fp8 before R21 wrote
    path.write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = tf.PatchTSTModel.from_pretrained(tmp_path / "fp8").eval()
    messages = [str(w.message) for w in caught if "float8_e4m3fn" in str(w.message)]
    assert len(messages) == 1 and "float32" in messages[0]
    assert back.dtype == torch.float32 and back.config.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(back(past_values=_inputs()).last_hidden_state, ref)
    back.save_pretrained(tmp_path / "again")  # and the re-save repairs config.json
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["dtype"] == "float32"


def test_llama_dtype_unchanged(tiny_model_dir):
    path = tiny_model_dir("llama")
    plain = tf.AutoModelForCausalLM.from_pretrained(path)
    q = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config("dynamic"))
    assert q.dtype == plain.dtype == _first_floating(plain).dtype == torch.float32
    q16 = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=Fp8Config("dynamic")
    )
    assert q16.dtype == torch.bfloat16


def test_other_fp8_parameters_are_left_to_transformers(tiny_model_dir):
    """A first fp8 parameter that no hf_fp8 layer holds: dtype as transformers says."""
    plain = tf.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    emb = plain.get_input_embeddings()
    emb.weight = torch.nn.Parameter(
        emb.weight.detach().to(torch.float8_e4m3fn), requires_grad=False
    )
    assert plain.dtype == torch.float8_e4m3fn


def test_fp8_activations_refused_with_the_fix():
    layer = Fp8Linear.from_linear(torch.nn.Linear(16, 8))
    assert isinstance(layer, Fp8Linear)
    x = torch.randn(2, 16)
    with pytest.raises(TypeError, match=r"float8_e4m3fn.*compute dtype.*float32"):
        layer(x.to(torch.float8_e4m3fn))
    assert layer(x).dtype == torch.float32
