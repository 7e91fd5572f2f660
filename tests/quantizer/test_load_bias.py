"""The bias of an FP8 layer is read from disk too: it must be a high-precision float (DESIGN §8).

A checkpoint whose ``Fp8Linear`` bias was stored as fp8 (e5m2) loaded silently: the bias
arrived as fp8 codes (fp8 bytes are kept as stored, for the checks), nothing checked it, and
the layer's ``compute_dtype`` was copied from it, so the model computed in float8 (relative
error 0.057 against the saved model). ``Fp8Experts``' ``{proj}_bias`` took the same path.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import _DECODER

LLAMA_BIAS = "model.layers.0.self_attn.q_proj.bias"
EXPERTS_BIAS = "model.layers.0.mlp.experts.gate_up_proj_bias"


def _save_fp8(model: torch.nn.Module, root) -> str:
    model.save_pretrained(root / "hp")
    fp8 = tf.AutoModelForCausalLM.from_pretrained(
        root / "hp", quantization_config=Fp8Config("dynamic")
    )
    fp8.save_pretrained(root / "fp8")
    return str(root / "fp8")


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = tf.LlamaConfig(**_DECODER, attention_bias=True, mlp_bias=True)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return _save_fp8(model, tmp_path_factory.mktemp("bias_llama"))


@pytest.fixture(scope="module")
def gpt_oss_fp8(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = tf.GptOssConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    return _save_fp8(model, tmp_path_factory.mktemp("bias_gpt_oss"))


def _with_bias(src: str, dst, key: str, dtype: torch.dtype) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    assert tensors[key].dtype == torch.float32  # hf_fp8 saves biases in high precision
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _load_error(path: str) -> str:
    """The message of the error loading ``path`` raises (``""`` when it loads)."""
    try:
        tf.AutoModelForCausalLM.from_pretrained(path)
    except CheckpointTensorError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn, torch.int32])
def test_fp8_or_integer_linear_bias_is_refused(llama_fp8, tmp_path, dtype) -> None:
    message = _load_error(_with_bias(llama_fp8, tmp_path / "bad", LLAMA_BIAS, dtype))
    assert re.search(re.escape(LLAMA_BIAS) + r": .*bias.*model\.safetensors", message), message


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.int32])
def test_fp8_or_integer_experts_bias_is_refused(gpt_oss_fp8, tmp_path, dtype) -> None:
    message = _load_error(_with_bias(gpt_oss_fp8, tmp_path / "bad", EXPERTS_BIAS, dtype))
    assert re.search(re.escape(EXPERTS_BIAS) + r": .*bias.*model\.safetensors", message), message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_valid_biases_load_and_compute_in_a_float_dtype(llama_fp8, gpt_oss_fp8, dtype) -> None:
    """The control: the checkpoints as saved load, compute dtype the model's (never fp8)."""
    for path, cls in ((llama_fp8, Fp8Linear), (gpt_oss_fp8, Fp8Experts)):
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        layers = [m for m in model.modules() if isinstance(m, cls)]
        assert layers
        assert {m.compute_dtype for m in layers} == {dtype}
        ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert model(ids).logits.dtype == dtype


def test_stale_nested_index_does_not_break_the_bias_checks(llama_fp8, tmp_path):
    """The bias checks named the file of each bias eagerly, parsing a
    ``model.safetensors.index.json`` left next to ``model.safetensors`` (transformers does not
    read it): a deeply nested one raised ``RecursionError`` (reviewer R3 3b). The file is only
    looked up for an error now."""
    folder = tmp_path / "m"
    shutil.copytree(llama_fp8, folder)
    (folder / "model.safetensors.index.json").write_text("[" * 100_000)
    reference = tf.AutoModelForCausalLM.from_pretrained(llama_fp8)
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    layer = model.get_submodule(LLAMA_BIAS.rpartition(".")[0])
    assert torch.equal(layer.bias, reference.get_submodule(LLAMA_BIAS.rpartition(".")[0]).bias)


def test_the_file_named_in_bias_errors_survives_a_hostile_stale_index(tmp_path):
    """``checkpoint_file`` (the file a bias error names, also called for every MoE expert
    bias) read a ``model.safetensors.index.json`` with plain ``json.load`` even when
    ``model.safetensors`` is there (transformers reads that one): a deeply nested index raised
    ``RecursionError`` out of the load."""
    from hf_fp8.quantizer.validation import checkpoint_file

    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text("[" * 100_000)
    assert checkpoint_file(str(tmp_path), "a.bias") == str(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    assert checkpoint_file(str(tmp_path), "a.bias") == str(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a.bias": "model-00002-of-00002.safetensors"}}'
    )
    assert checkpoint_file(str(tmp_path), "a.bias") == str(
        tmp_path / "model-00002-of-00002.safetensors"
    )
