"""The small Llama that examples and recipes train from scratch on CPU."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig


def tiny_llama_config(
    hidden: int, layers: int, seq_len: int, vocab_size: int = 256, **extra: Any
) -> LlamaConfig:
    """Llama with 4 heads (2 KV heads), MLP width 3 × ``hidden``; bytes as tokens by default."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        **extra,
    )
