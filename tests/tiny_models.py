"""Tiny, randomly initialised models of each family, saved once per session (no Hub).

Conftests import the ``tiny_model_dir`` fixture from here."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

VOCAB = 128
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# decoder sizes without the MLP width (dense and MoE families set their own)
DECODER_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
# one decoder layer, untied head: the peft tests' tiny Llama
LLAMA_ONE_LAYER = {**_DECODER, "num_hidden_layers": 1, "tie_word_embeddings": False}

TINY = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, _DECODER),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {**_DECODER, "head_dim": 16}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, _DECODER),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {**_DECODER, "head_dim": 16}),
    "gpt2": (
        tf.GPT2Config,
        tf.GPT2LMHeadModel,
        dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "bert": (
        tf.BertConfig,
        tf.BertModel,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
    ),
    "t5": (
        tf.T5Config,
        tf.T5ForConditionalGeneration,
        dict(
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        ),
    ),
}


def model_inputs(family: str, batch: int = 2, seq: int = 12, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    if family == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :6]}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def model_output(model, inputs) -> torch.Tensor:
    out = model(**inputs)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(family, dtype)`` → folder of a saved tiny model."""
    cache = {}

    def build(family: str, dtype: torch.dtype = torch.float32) -> str:
        key = (family, dtype)
        if key not in cache:
            config_cls, model_cls, kwargs = TINY[family]
            torch.manual_seed(0)
            model = model_cls(config_cls(**kwargs)).to(dtype).eval()
            path = tmp_path_factory.mktemp(f"{family}_{str(dtype).split('.')[-1]}")
            model.save_pretrained(path)
            cache[key] = str(path)
        return cache[key]

    return build


# Llama with its second decoder layer offloaded to disk (accelerate device_map).
LLAMA_LAYER_1_ON_DISK = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="session")
def llama_fp8_dir(tiny_model_dir, tmp_path_factory):
    """Folder of the tiny Llama loaded with ``Fp8Config("dynamic")`` and saved (pre-quantized).
    Shared by the whole session: copy it before changing anything in it."""
    from transformers import AutoModelForCausalLM

    from hf_fp8 import Fp8Config

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )
    path = tmp_path_factory.mktemp("llama_fp8_dynamic")
    model.save_pretrained(path)
    return path


def tiny_mixtral():
    """A 2-layer Mixtral (4 experts) in fp32 eval mode; seed the RNG before calling."""
    import transformers as tf

    config = tf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        intermediate_size=32,
        num_local_experts=4,
    )
    return tf.MixtralForCausalLM(config).eval()
