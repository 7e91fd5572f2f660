"""A config.json whose weight_granularity / block_size disagrees with the stored scales of FP8
MoE experts (``<proj>_weight_scale``): refused before loading, naming the tensor, the file
and the granularity the file holds, as for ``Fp8Linear`` weight scales (before: transformers'
size report advising ``ignore_mismatched_sizes=True``, which re-initialised the scales and
then refused them as "missing"). A matching config still loads with identical outputs.

Every linear outside the experts stays high precision, so only expert scales can disagree.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import DECODER_SIZES

SIZES = {**DECODER_SIZES, "num_experts_per_tok": 2}
# family -> (config class, config, linears kept high precision besides lm_head);
# mixtral stores its experts as block_sparse_moe (renamed by transformers while loading),
# llama4_text's are Fp8BmmExperts, jetmoe's Fp8ParallelExperts (in attention too)
FAMILIES = {
    "qwen3_moe": (
        tf.Qwen3MoeConfig,
        dict(SIZES, moe_intermediate_size=64, num_experts=4),
        ["self_attn"],
    ),
    "mixtral": (
        tf.MixtralConfig,
        dict(SIZES, intermediate_size=64, num_local_experts=4),
        ["self_attn"],
    ),
    "llama4_text": (
        tf.Llama4TextConfig,
        dict(SIZES, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4),
        ["self_attn", "shared_expert"],
    ),
    "jetmoe": (
        tf.JetMoeConfig,
        dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_key_value_heads=2,
            kv_channels=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        ),
        ["kv_proj"],
    ),
}
ROW = dict(weight_granularity="row")
TENSOR = dict(weight_granularity="tensor")
BLOCK32 = dict(weight_granularity="block", block_size=[32, 32])


@pytest.fixture(scope="module")
def hp_dir(tmp_path_factory):
    cache = {}

    def build(family: str):
        if family not in cache:
            config_cls, kwargs, _ = FAMILIES[family]
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
            cache[family] = tmp_path_factory.mktemp(family) / "hp"
            model.save_pretrained(cache[family])
        return cache[family]

    return build


def _quantized(hp_dir, family: str, recipe: dict) -> tf.PreTrainedModel:
    keep = ["lm_head", *FAMILIES[family][2]]
    config = Fp8Config("weight_only", modules_to_not_convert=keep, **recipe)
    model = tf.AutoModelForCausalLM.from_pretrained(hp_dir(family), quantization_config=config)
    model.eval()
    experts = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    assert experts and not any(type(m).__name__ == "Fp8Linear" for m in model.modules()), (
        "only the experts are FP8 here"
    )
    return model


def _saved(hp_dir, family: str, path, recipe: dict, claim: dict) -> str:
    _quantized(hp_dir, family, recipe).save_pretrained(path)
    config_json = path / "config.json"
    data = json.loads(config_json.read_text())
    data["quantization_config"].update(claim)
    config_json.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ignore", [False, True])
def test_row_expert_scales_under_a_tensor_config_name_row(hp_dir, tmp_path, family, ignore):
    path = _saved(hp_dir, family, tmp_path, ROW, TENSOR)
    with pytest.raises(CheckpointTensorError, match="weight_granularity='row'") as err:
        tf.AutoModelForCausalLM.from_pretrained(path, ignore_mismatched_sizes=ignore)
    message = str(err.value)
    assert re.search(r"\.\w+_weight_scale: stored with shape \[4, \d+, 1\] in ", message)
    assert f"{path}/model.safetensors" in message and f"{path}/config.json" in message
    assert "weight_granularity='tensor'" in message  # what the config claims


@pytest.mark.parametrize(
    ("saved", "claim", "named"),
    [
        (TENSOR, ROW, "weight_granularity='tensor'"),
        (BLOCK32, ROW, r"weight_granularity='block', block_size=\[32, 32\]"),
        (BLOCK32, dict(block_size=[64, 64]), r"weight_granularity=.block., block_size=\[32, 32\]"),
        (ROW, BLOCK32, "weight_granularity='row'"),
    ],
    ids=["tensor-as-row", "block-as-row", "block32-as-block64", "row-as-block"],
)
def test_other_expert_granularities_are_named(hp_dir, tmp_path, saved, claim, named):
    path = _saved(hp_dir, "qwen3_moe", tmp_path, saved, claim)
    with pytest.raises(
        CheckpointTensorError, match=rf"_weight_scale: .*The stored scales are {named}"
    ):
        tf.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", [ROW, TENSOR, BLOCK32], ids=["row", "tensor", "block"])
def test_matching_config_still_loads_exactly(hp_dir, tmp_path, family, recipe):
    """Save -> load gives the saved model's expert codes, scales and logits bit for bit."""
    model = _quantized(hp_dir, family, recipe)
    model.save_pretrained(tmp_path)
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    saved = {n: t for n, t in model.state_dict().items() if "experts" in n}
    loaded = again.state_dict()
    assert saved and all(torch.equal(loaded[n], t) for n, t in saved.items())
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_scale_that_fits_no_granularity_names_the_experts_weights():
    """Direct check: another expert count is no granularity of these weights."""
    from hf_fp8.quantizer.validation import check_weight_scale_shape

    recipe = Fp8Config("weight_only").recipe  # row
    check_weight_scale_shape("e.down_proj_weight_scale", (4, 64, 1), (4, 64, 128), recipe, root="")
    with pytest.raises(CheckpointTensorError) as err:
        check_weight_scale_shape(
            "e.down_proj_weight_scale", (3, 64, 1), (4, 64, 128), recipe, root=""
        )
    message = str(err.value)
    assert message.startswith("e.down_proj_weight_scale: stored with shape [3, 64, 1]")
    assert "(a weight scale of shape [4, 64, 1])" in message
    assert "fits no weight granularity of a [64, 128] weight of 4 experts" in message
