"""The experts rule (``experts_keep_reason`` / ``convertible_experts``): which experts modules
become ``Fp8Experts``, and why the others stay in high precision."""

from __future__ import annotations

import torch
import transformers as tf
from torch import nn
from transformers.models.llama4 import modeling_llama4

from hf_fp8.modules.fp8_experts import (
    Fp8Experts,
    convertible_experts,
    experts_keep_reason,
    is_experts_module,
    unconverted_experts,
)


def _tiny_qwen3_moe() -> nn.Module:
    cfg = tf.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return tf.Qwen3MoeForCausalLM(cfg)


def test_every_decorated_experts_module_converts_and_nothing_else() -> None:
    model = _tiny_qwen3_moe()
    found = convertible_experts(model)
    assert [n for n, _, _ in found] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(parent.experts is module for _, module, parent in found)
    assert experts_keep_reason(model.model.layers[0].mlp.gate, "g") == "not an experts module"
    assert experts_keep_reason(nn.Linear(2, 2), "x") == "not an experts module"


def test_skip_and_filter_keep_experts() -> None:
    model = _tiny_qwen3_moe()
    found = convertible_experts(model, skip=["model.layers.0.mlp.experts"])
    assert [n for n, _, _ in found] == ["model.layers.1.mlp.experts"]
    found = convertible_experts(model, module_filter_fn=lambda m, n: "layers.1" not in n)
    assert [n for n, _, _ in found] == ["model.layers.0.mlp.experts"]


def test_experts_outside_the_interface_are_refused_with_the_reason() -> None:
    llama4 = modeling_llama4.Llama4TextExperts(
        modeling_llama4.Llama4TextConfig(hidden_size=32, intermediate_size=24, num_local_experts=4)
    )
    assert is_experts_module(llama4)
    reason = experts_keep_reason(llama4, "layers.0.experts")
    assert reason is not None and "use_experts_implementation" in reason
    holder = nn.Module()
    holder.experts = llama4
    assert convertible_experts(holder) == []
    assert "use_experts_implementation" in unconverted_experts(holder)["experts"]


def test_converted_experts_are_not_listed_again() -> None:
    model = _tiny_qwen3_moe()
    layer = model.model.layers[0].mlp
    layer.experts = Fp8Experts.from_experts(layer.experts)
    assert [n for n, _, _ in convertible_experts(model)] == ["model.layers.1.mlp.experts"]
    assert list(unconverted_experts(model)) == ["model.layers.1.mlp.experts"]
    assert torch.float8_e4m3fn == layer.experts.gate_up_proj.dtype
