"""``inspect`` / the model card count FP8 experts as FP8 whatever the family's checkpoint
names (issue 11 'seeing it'). Reference: the dtypes of the saved tensors themselves.

Families whose experts transformers merges with a plain mapping (Qwen3-MoE) are counted
right by ``serialization.experts.experts_view``. Families whose checkpoints store the experts
fused already (gpt-oss, Llama-4: no mapping) or rename them (GraniteMoE: ``input_linear`` <->
``experts.gate_up_proj``), and JetMoE's ``Fp8ParallelExperts`` (scales
``weight_weight_scale``) are found by ``serialization.experts.fused_experts``; before it, the
summary reported their fp8 codes as "experts not in FP8" (gpt-oss tiny: 0.10 FP8 share
instead of 0.95).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors import safe_open

from hf_fp8 import Fp8Config
from hf_fp8.serialization.summary import inspect_checkpoint

SIZES = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
FAMILIES = {
    "qwen3_moe": (tf.Qwen3MoeConfig, dict(moe_intermediate_size=32, num_experts=4)),
    "gpt_oss": (tf.GptOssConfig, dict(intermediate_size=32, num_local_experts=4)),
    "llama4_text": (
        tf.Llama4TextConfig,
        dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4),
    ),
    "granitemoe": (tf.GraniteMoeConfig, dict(intermediate_size=32, num_local_experts=4)),
    "jetmoe": (tf.JetMoeConfig, dict(intermediate_size=32, kv_channels=8, num_local_experts=4)),
}


def _stored_fp8_share(folder) -> float:
    fp8 = total = 0
    with safe_open(folder / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if "scale" in key:
                continue
            info = f.get_slice(key)
            numel = int(torch.tensor(info.get_shape()).prod()) if info.get_shape() else 1
            total += numel
            fp8 += numel if info.get_dtype().startswith("F8") else 0
    return fp8 / total


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "gpt_oss",
        "llama4_text",
        "granitemoe",
        "jetmoe",
    ],
)
def test_inspect_counts_fp8_experts_as_fp8(family: str, tmp_path) -> None:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**SIZES, num_experts_per_tok=2, **extra)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "hp")
    fp8 = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("dynamic")
    )
    fp8.save_pretrained(tmp_path / "fp8")
    summary = inspect_checkpoint(tmp_path / "fp8")
    assert summary.fp8_share == pytest.approx(_stored_fp8_share(tmp_path / "fp8"), rel=1e-9)
    assert all(part["what"] != "experts not in FP8" for part in summary.high_precision_parts)


def test_inspect_and_card_accept_block_scales_straddling_gate_and_up(tmp_path) -> None:
    """An hf_fp8 Qwen3-MoE with moe_intermediate_size=96 and 128-row blocks (one block spans
    gate and up) reloads fine, so inspect and the push card read it; the merged block scales
    are still checked against the merged codes (a zero scale is named). Export still refuses
    it: test_moe_formats.py::test_export_of_blocks_straddling_gate_and_up_is_refused."""
    from safetensors.torch import load_file, save_file

    from hf_fp8.hub.push import card_for_folder
    from hf_fp8.numerics.checks import CheckpointTensorError
    from tests.serialization.test_moe_formats import _hf_fp8_moe_dir

    src = _hf_fp8_moe_dir(tmp_path, 96, (128, 128))
    summary = inspect_checkpoint(src)
    assert "model.layers.0.mlp.experts.gate_up_proj" in summary.fp8_layers
    card_for_folder(src, "me/x")

    name = "model.layers.0.mlp.experts.gate_up_proj_weight_scale"
    weights = load_file(src / "model.safetensors")
    assert tuple(weights[name].shape) == (4, 2, 1)  # [E, ceil(192/128), ceil(128/128)]
    weights[name][1, 1, 0] = 0.0
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointTensorError, match=name):
        inspect_checkpoint(src)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4_text", "granitemoe"])
def test_inspect_names_experts_kept_by_modules_to_not_convert(family: str, tmp_path) -> None:
    """Experts the user kept in high precision (``modules_to_not_convert=["experts"]``) are
    reported as kept by that option, not as "MoE experts that Fp8Experts cannot carry"
    (which sent the user looking for a limitation that was not there)."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**SIZES, num_experts_per_tok=2, **extra)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hp")
    fp8 = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp",
        quantization_config=Fp8Config("dynamic", modules_to_not_convert=["experts"]),
    )
    fp8.save_pretrained(tmp_path / "fp8")
    summary = inspect_checkpoint(tmp_path / "fp8")
    kinds = {part["what"] for part in summary.high_precision_parts}
    assert "modules_to_not_convert" in kinds
    assert "experts not in FP8" not in kinds
