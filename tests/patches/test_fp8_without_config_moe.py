"""An hf_fp8 MoE checkpoint whose only FP8 layers are the experts, loaded without its
quantization_config, is refused on every path (reviewer R9 finding 1).

Before: hf_fp8 saves the expert codes one per expert (``...experts.0.w1.weight``) and their
scales under the merged name (``...experts.gate_up_proj_weight_scale``); the check paired an
fp8 tensor only with a scale of the same module, so with attention kept in high precision it
found no pair: the safetensors folder, ``pytorch_model.bin``, ``config=`` of the base model,
``FineGrainedFP8Config(dequantize=True)`` on the fly and ``from_pretrained(state_dict=...)``
all loaded the fp8 codes as plain weights (logits 1.43 off relative).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
)
FAMILIES = {
    "mixtral": lambda: tf.MixtralConfig(**SIZES, intermediate_size=32, num_local_experts=4),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(
        **SIZES, head_dim=16, moe_intermediate_size=32, num_experts=4
    ),
    # codes saved fused under the stored name (input_linear.weight), scales under the model's
    "granitemoe": lambda: tf.GraniteMoeConfig(**SIZES, intermediate_size=32, num_local_experts=4),
}
# the refusal names a stored fp8 code and a merged experts scale
REFUSED = r"\.weight in .* is FP8 \(F8_E4M3\) with its scale .*experts\.\w+_proj_weight_scale"
IDS = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def _without_quantization_config(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def experts_only(tmp_path_factory):
    """``family -> (folders, the FP8 model)``: its float folder ``hp``, the experts-only FP8
    save ``fp8``, that folder without its quantization_config (``lost``) and as a
    ``pytorch_model.bin`` (``lostbin``)."""
    cache = {}

    def build(family: str):
        if family in cache:
            return cache[family]
        root = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(FAMILIES[family]()).save_pretrained(root / "hp")
        config = Fp8Config("dynamic", modules_to_not_convert=["self_attn", "lm_head"])
        model = tf.AutoModelForCausalLM.from_pretrained(
            root / "hp", dtype=torch.float32, quantization_config=config
        ).eval()
        model.save_pretrained(root / "fp8")
        lost = _without_quantization_config(root / "fp8", root / "lost")
        lostbin = _without_quantization_config(root / "fp8", root / "lostbin")
        (lostbin / "model.safetensors").unlink()
        torch.save(load_file(lost / "model.safetensors"), lostbin / "pytorch_model.bin")
        folders = {"hp": root / "hp", "fp8": root / "fp8", "lost": lost, "lostbin": lostbin}
        cache[family] = folders, model
        return cache[family]

    return build


def _no_code_shares_its_module_with_a_scale(folder: Path) -> None:
    """The layout the finding needs: no fp8 tensor shares its module with a scale."""
    tensors = load_file(folder / "model.safetensors")
    fp8 = [k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn]
    scales = {k.rpartition(".")[0] for k in tensors if "scale" in k}
    assert fp8 and all(k.rpartition(".")[0] not in scales for k in fp8)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_only_fp8_folder_without_its_config_is_refused(family, experts_only):
    folders, _ = experts_only(family)
    _no_code_shares_its_module_with_a_scale(folders["fp8"])
    for folder in (folders["lost"], folders["lostbin"]):
        with pytest.raises(CheckpointTensorError, match=REFUSED):
            tf.AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_only_fp8_folder_with_the_base_config_is_refused(family, experts_only):
    folders, _ = experts_only(family)
    base = tf.AutoConfig.from_pretrained(folders["hp"])
    with pytest.raises(CheckpointTensorError, match=REFUSED):
        tf.AutoModelForCausalLM.from_pretrained(folders["fp8"], config=base)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_only_fp8_folder_quantized_on_the_fly_is_refused(family, experts_only):
    folders, _ = experts_only(family)
    with pytest.raises(CheckpointTensorError, match=REFUSED + r".*quant_method='fp8'"):
        tf.AutoModelForCausalLM.from_pretrained(
            folders["lost"], quantization_config=tf.FineGrainedFP8Config(dequantize=True)
        )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_only_fp8_state_dict_without_its_config_is_refused(family, experts_only):
    """The saved tensors (codes per expert) and the model's own state dict (merged codes)."""
    folders, model = experts_only(family)
    base = tf.AutoConfig.from_pretrained(folders["hp"])
    saved = load_file(folders["fp8"] / "model.safetensors")
    with pytest.raises(
        CheckpointTensorError, match=REFUSED.replace("in .*", "in the state_dict= passed")
    ):
        type(model).from_pretrained(None, config=base, state_dict=saved)
    with pytest.raises(
        CheckpointTensorError, match=r"experts\.\w+_proj in the state_dict= passed is FP8"
    ):
        type(model).from_pretrained(None, config=base, state_dict=model.state_dict())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_only_fp8_folder_with_its_config_loads_the_fp8_model(family, experts_only):
    folders, model = experts_only(family)
    loaded = tf.AutoModelForCausalLM.from_pretrained(folders["fp8"]).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
