"""MoE experts kept in high precision are named in the export's ``ignore`` (compressed-tensors)
and ``ignored_layers`` (vLLM ``fp8``) as vLLM matches them (``tests/serialization/vllm_rules``).

Known gap: experts stored as one fused 3-D parameter per layer (Llama-4 ``Llama4TextExperts``,
gpt-oss ``GptOssExperts``, GraniteMoE, saved as ``input_linear``) were not listed at all, so
vLLM would read their high-precision tensors as FP8; Mixtral's (stored per expert as
``w1`` / ``w2`` / ``w3``) were listed under those names, which vLLM's compressed-tensors
fused-MoE loader never asks about (it asks about ``<layer>.0.gate_proj`` …).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config
from hf_fp8.serialization import export_checkpoint, import_checkpoint
from tests.serialization.helpers import fp32_close, stock_load
from tests.serialization.vllm_rules import ct_ignores_moe, ct_old_ignores_moe, fp8_skips_moe

SIZES = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    num_experts_per_tok=2,
)
# family -> (config class, extra config, vLLM's FusedMoE prefix of layer {i}: checkpoint names)
FAMILIES = {
    "llama4_text": (
        tf.Llama4TextConfig,
        dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4),
        "model.layers.{i}.feed_forward.experts",
    ),
    "gpt_oss": (
        tf.GptOssConfig,
        dict(intermediate_size=32, num_local_experts=4),
        "model.layers.{i}.mlp.experts",
    ),
    "granitemoe": (
        tf.GraniteMoeConfig,
        dict(intermediate_size=32, num_local_experts=4),
        "model.layers.{i}.block_sparse_moe.experts",
    ),
    "mixtral": (
        tf.MixtralConfig,
        dict(intermediate_size=32, num_local_experts=4),
        "model.layers.{i}.block_sparse_moe.experts",
    ),
    "qwen3_moe": (
        tf.Qwen3MoeConfig,
        dict(moe_intermediate_size=32, num_experts=4),
        "model.layers.{i}.mlp.experts",
    ),
    # stored block_sparse_moe, the model's mlp; lightning attention keeps 3-D float buffers
    # (slope_rate, query_decay, key_decay) that are not experts
    "minimax": (
        tf.MiniMaxConfig,
        dict(
            intermediate_size=32,
            num_local_experts=4,
            block_size=16,
            layer_types=["linear_attention", "full_attention"],
        ),
        "model.layers.{i}.block_sparse_moe.experts",
    ),
}
CT = "compressed-tensors"
# per-tensor weights and activations: a recipe both formats hold
RECIPE = dict(weight_granularity="tensor", activation_granularity="tensor")


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    cache = {}

    def build(family: str):
        if family not in cache:
            config_cls, extra, _ = FAMILIES[family]
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config_cls(**SIZES, **extra)).eval()
            cache[family] = tmp_path_factory.mktemp(family) / "hp"
            model.save_pretrained(cache[family])
        return cache[family]

    return build


def _quantized(path, skip: list[str]):
    config = Fp8Config("dynamic", **RECIPE, modules_to_not_convert=skip)
    return tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config
    ).eval()


def _export(model, out, fmt: str) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vllm-fp8: vLLM picks the granularity per platform
        export_checkpoint(model, out, fmt)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    return qc["ignore"] if fmt == "compressed-tensors" else qc["ignored_layers"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_high_precision_experts_are_ignored_as_vllm_matches_them(family, family_dir, tmp_path):
    model = _quantized(family_dir(family), ["experts"])
    layer = FAMILIES[family][2]
    ct = _export(model, tmp_path / "ct", "compressed-tensors")
    fp8 = _export(model, tmp_path / "fp8", "vllm-fp8")
    for i in range(SIZES["num_hidden_layers"]):
        assert ct_ignores_moe(ct, layer.format(i=i)), (i, ct)
        assert ct_old_ignores_moe(ct, layer.format(i=i)), (i, ct)
        assert fp8_skips_moe(fp8, layer.format(i=i)), (i, fp8)
    # the FP8 linears stay quantized
    assert not any("self_attn" in n or "q_proj" in n for n in ct + fp8)


def test_fp8_experts_next_to_high_precision_ones_stay_quantized(family_dir, tmp_path):
    """Only layer 0's experts are kept: layer 1's FP8 experts must not match any rule."""
    model = _quantized(family_dir("qwen3_moe"), ["model.layers.0.mlp.experts"])
    ct = _export(model, tmp_path / "ct", "compressed-tensors")
    fp8 = _export(model, tmp_path / "fp8", "vllm-fp8")
    assert ct_ignores_moe(ct, "model.layers.0.mlp.experts")
    assert fp8_skips_moe(fp8, "model.layers.0.mlp.experts")
    assert not ct_ignores_moe(ct, "model.layers.1.mlp.experts")
    assert not ct_old_ignores_moe(ct, "model.layers.1.mlp.experts")
    assert not fp8_skips_moe(fp8, "model.layers.1.mlp.experts")


@pytest.mark.parametrize("family", ["minimax", "mixtral"])
def test_all_fp8_experts_are_not_ignored(family, family_dir, tmp_path):
    """R9 4: an all-FP8 MiniMax export listed its FP8 experts as high precision (26 of 27
    ignore entries): its 3-D buffers made the exporter look on the model for fused experts,
    and it looked for their scales under the model's names (``mlp``) among the stored ones
    (``block_sparse_moe``). Nothing but what is kept in high precision is ignored."""
    model = _quantized(family_dir(family), [])
    assert any(type(m).__name__ == "Fp8Experts" for m in model.modules())
    ct = _export(model, tmp_path / "ct", CT)
    fp8 = _export(model, tmp_path / "fp8", "vllm-fp8")
    assert not [x for x in ct + fp8 if "experts" in x], (ct, fp8)
    for i in range(SIZES["num_hidden_layers"]):
        layer = FAMILIES[family][2].format(i=i)
        assert not ct_ignores_moe(ct, layer) and not ct_old_ignores_moe(ct, layer)
        assert not fp8_skips_moe(fp8, layer)


@pytest.mark.parametrize("family", ["llama4_text", "gpt_oss"])
def test_fused_high_precision_experts_export_loads_with_same_outputs(family, family_dir, tmp_path):
    """Stock transformers + compressed-tensors reads the export (fused high-precision experts
    as they are, FP8 linears dequantized) and gives the hf_fp8 model's logits in fp32."""
    model = _quantized(family_dir(family), ["experts"])
    _export(model, tmp_path / "ct", "compressed-tensors")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        got = stock_load(tmp_path / "ct")(ids).logits
    assert fp32_close(got, want) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("fmt", [CT, "vllm-fp8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_high_precision_experts_import_back_bit_exact(family, fmt, family_dir, tmp_path):
    """``hf-fp8 import`` of the export keeps the experts in high precision under the model's
    own names (Mixtral's checkpoint says ``block_sparse_moe``, the model ``mlp``; gpt-oss,
    Llama-4 and GraniteMoE store them fused): same logits. Before, the import quantized
    them on load and failed on the missing scales. Llama-4's compressed-tensors export writes
    them one linear per expert (for stock transformers): the import fuses them back."""
    model = _quantized(family_dir(family), ["experts"])
    _export(model, tmp_path / "out", fmt)
    back = tf.AutoModelForCausalLM.from_pretrained(
        import_checkpoint(tmp_path / "out", tmp_path / "back")
    )
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
