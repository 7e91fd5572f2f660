"""Reviewer R32 F4: ``model.dequantize()`` of an FP8 model the user froze except its biases
(BitFit) or its norms made every dense weight trainable (BitFit: 1,024 -> 74,752 trainable
parameters; norms only: 320 -> 74,048), while the float model with the same freezing keeps its
linear weights frozen. The FP8 weights carry no trainable flag, so ``dequantize`` reads it from
the model's other weight matrices (the high-precision ``lm_head``, ``embed_tokens``), not from
its biases and norms: all of them train -> the dense weights train (a full fine-tune); any of
them frozen -> frozen, with a warning naming how to train them when something else trains.

Reference: the float model (same weights, same freezing), its ``requires_grad`` flags."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from tests.tiny_models import tiny_mixtral


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    """A tiny Llama with biases in every linear (BitFit has something to train)."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
        mlp_bias=True,
    )
    path = tmp_path_factory.mktemp("bias_llama") / "float"
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _freeze(model, mode: str):
    """The user's freezing, applied alike to the float and the FP8 model."""
    if mode == "full":
        return model.requires_grad_(True)
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        if (
            (mode == "bitfit" and name.endswith(".bias"))
            or (mode == "norms" and "norm" in name)
            or (mode == "probe" and name.startswith("lm_head."))
        ):
            p.requires_grad_(True)
    return model


def _flags(model) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _dequantized(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.dequantize()
    return [str(w.message) for w in caught if "hf_fp8" in str(w.message)]


@pytest.mark.parametrize("mode", ["bitfit", "norms", "probe", "frozen", "full"])
def test_dequantize_follows_the_float_models_freezing(float_dir, mode):
    reference = _freeze(tf.LlamaForCausalLM.from_pretrained(float_dir), mode)
    model = tf.LlamaForCausalLM.from_pretrained(float_dir, quantization_config=Fp8Config("dynamic"))
    _freeze(model, mode)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    trainable = _trainable(model)
    messages = _dequantized(model)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert _flags(model) == _flags(reference)
    assert _trainable(model) == _trainable(reference)
    if mode in ("bitfit", "norms", "probe"):  # partly frozen: said, with the fix
        assert _trainable(model) == trainable  # no dense weight was made trainable
        assert len(messages) == 1 and "requires_grad_(True)" in messages[0]
    else:
        assert messages == []


def test_bitfit_counts_of_the_report(float_dir):
    """The reviewer's figures: BitFit trains the 1,024 bias values, before and after."""
    model = tf.LlamaForCausalLM.from_pretrained(float_dir, quantization_config=Fp8Config("dynamic"))
    _freeze(model, "bitfit")
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    assert _trainable(model) == biases == 1024
    _dequantized(model)
    assert _trainable(model) == 1024
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert model.model.layers[0].self_attn.q_proj.bias.requires_grad


def test_frozen_embeddings_warn_with_the_fix_that_gives_the_float_flags(float_dir):
    """Embeddings frozen, the rest trained: the dense weights cannot be told from a probe's
    and stay frozen, with a warning; its fix gives the float model's flags."""
    reference = tf.LlamaForCausalLM.from_pretrained(float_dir)
    reference.model.embed_tokens.requires_grad_(False)
    model = tf.LlamaForCausalLM.from_pretrained(float_dir, quantization_config=Fp8Config("dynamic"))
    model.model.embed_tokens.requires_grad_(False)
    linears = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    (message,) = _dequantized(model)
    assert "requires_grad_(True)" in message and f"{len(linears)} dense" in message
    assert "model.layers.0.self_attn.q_proj.weight" in message
    for name in linears:  # the fix the warning names
        model.get_submodule(name).weight.requires_grad_(True)
    assert _flags(model) == _flags(reference)


def test_experts_follow_the_float_models_freezing():
    """MoE: norms-only tuning keeps the dequantized experts frozen, as the float model's."""
    torch.manual_seed(0)
    reference = _freeze(tiny_mixtral(), "norms")
    fp8 = quantize_model(copy.deepcopy(reference), Fp8Config("weight_only"))
    assert any(type(m).__name__ == "Fp8Experts" for m in fp8.modules())
    _freeze(fp8, "norms")
    linears = sum(isinstance(m, Fp8Linear) for m in fp8.modules())
    experts = sum(type(m).__name__ == "Fp8Experts" for m in fp8.modules())
    (message,) = _dequantized(fp8)
    assert f"{linears + 2 * experts} dense" in message  # gate_up_proj, down_proj each
    assert _flags(fp8) == _flags(reference)
