"""Tiny Qwen3-MoE checkpoints for the MoE serialization tests: high precision, and the
``fp8`` block format that Qwen3-MoE-FP8 / DeepSeek-V3 ship (one fp8 linear per expert with
``weight_scale_inv`` on 128 × 128 blocks), written here with safetensors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from hf_fp8.numerics import quantize_weight

BLOCK = (128, 128)
# what the fp8 block checkpoints quantize: attention and expert projections
FP8_LINEAR = re.compile(r"(self_attn\.[qkvo]_proj|experts\.\d+\.(gate|up|down)_proj)\.weight$")


def tiny_qwen3_moe(seed: int = 0) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return tf.Qwen3MoeForCausalLM(cfg).eval()


def write_fp8_block_checkpoint(model: tf.PreTrainedModel, out: Path) -> dict[str, torch.Tensor]:
    """``model`` saved as an ``fp8`` block checkpoint; returns the fp8 tensors written."""
    model.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    written = {}
    for name in list(tensors):
        if FP8_LINEAR.search(name):
            codes, scale = quantize_weight(
                tensors[name].float(), torch.float8_e4m3fn, "block", BLOCK
            )
            tensors[name] = codes
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
            written[name] = codes
            written[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
    }
    (out / "config.json").write_text(json.dumps(config))
    return written
