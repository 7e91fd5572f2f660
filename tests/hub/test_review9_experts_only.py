"""A model whose only FP8 layers are MoE experts (attention and head kept high precision) is an
hf_fp8 model: ``hf_fp8.export(model)`` writes what the export of its saved folder writes
(was: refused, "not an hf_fp8 model"), and its saves carry the model card."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.hub import hooks, read_card_info
from hf_fp8.modules import Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts
from tests.serialization.moe_fixtures import tiny_qwen3_moe

EXPERTS_ONLY = Fp8Config("dynamic", modules_to_not_convert=["lm_head", "self_attn"])


@pytest.fixture
def experts_only(tmp_path):
    tiny_qwen3_moe().save_pretrained(tmp_path / "hp")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hp", quantization_config=EXPERTS_ONLY)
    assert any(isinstance(m, Fp8Experts) for m in model.modules())
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    return model


@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-fp8"])
def test_export_of_an_experts_only_model_matches_the_export_of_its_folder(
    experts_only, tmp_path, fmt
):
    if fmt == "vllm-fp8":  # per-tensor weights: what vLLM's fp8 format stores
        experts_only = AutoModelForCausalLM.from_pretrained(
            tmp_path / "hp",
            quantization_config=EXPERTS_ONLY.replace(
                weight_granularity="tensor", activation_granularity="tensor"
            ),
        )
    experts_only.save_pretrained(tmp_path / "fp8")
    reference = hf_fp8.export(tmp_path / "fp8", tmp_path / "from-folder", fmt)
    got = hf_fp8.export(experts_only, tmp_path / "from-model", fmt)
    want, have = load_file(reference / "model.safetensors"), load_file(got / "model.safetensors")
    assert want.keys() == have.keys()
    assert any(t.dtype == torch.float8_e4m3fn for t in want.values())
    for key, tensor in want.items():
        assert torch.equal(
            have[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), key


def test_save_of_an_experts_only_model_writes_the_card(experts_only, tmp_path):
    assert hooks._is_fp8(experts_only)
    hf_fp8.set_card_info(experts_only, fidelity={"logits relative error": 0.01})
    experts_only.save_pretrained(tmp_path / "fp8")
    info = read_card_info((tmp_path / "fp8" / "README.md").read_text(encoding="utf-8"))
    assert info.fidelity == {"logits relative error": 0.01}
    assert info.fp8_layers == 4  # gate_up_proj and down_proj of both layers' experts


def test_card_counts_fp8_layers_as_the_checkpoint_summary_does(tmp_path):
    """The card of a loaded model said 8 FP8 linear layers for a MoE model whose checkpoint
    card (hf_fp8.inspect_checkpoint, push_folder) said 12: experts were not counted."""
    from hf_fp8.hub import info_from_model

    tiny_qwen3_moe().save_pretrained(tmp_path / "hp")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "hp", quantization_config=Fp8Config("dynamic")
    )
    model.save_pretrained(tmp_path / "fp8")
    summary = hf_fp8.inspect_checkpoint(tmp_path / "fp8")
    # 2 layers x (q, k, v, o + the experts' gate_up_proj and down_proj)
    assert info_from_model(model).fp8_layers == len(summary.fp8_layers) == 12
