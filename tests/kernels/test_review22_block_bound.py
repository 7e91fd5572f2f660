"""R22 F1: a block size beyond int64 wrapped in ctypes (2**64 + 32 became 32): the C kernels
wrote m x 2 activation scales into an m x 1 buffer (heap corruption, abort) or read block
scales past their buffer (silently wrong logits). Block sizes are bounded where a recipe is
made (config.json, Fp8Config, importers all pass through it) and again before every C call."""

from __future__ import annotations

import json

import pytest
import torch

from hf_fp8 import Fp8Config
from hf_fp8.kernels import cpu_kernel
from hf_fp8.recipe import MAX_BLOCK, Fp8Recipe

HUGE = [2**64 + 32, 2**63, 2**31]


@pytest.mark.parametrize("huge", HUGE)
def test_config_and_recipe_refuse_block_sizes_beyond_the_bound(huge) -> None:
    for block in ([huge, 128], [128, huge]):
        with pytest.raises(ValueError, match="block_size"):
            Fp8Config("dynamic", weight_granularity="block", block_size=block)
        with pytest.raises(ValueError, match="block_size"):
            Fp8Recipe.resolve("dynamic", weight_granularity="block", block_size=block)
    # the largest allowed size still means "one block covers the matrix"
    recipe = Fp8Recipe.resolve(
        "weight_only", weight_granularity="block", block_size=[MAX_BLOCK] * 2
    )
    assert recipe.block_size == (MAX_BLOCK, MAX_BLOCK)


def test_a_saved_config_with_a_huge_block_size_is_refused_at_load(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "base")
    q = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base",
        quantization_config=Fp8Config("dynamic", weight_granularity="block", block_size=[128, 128]),
    )
    q.save_pretrained(tmp_path / "fp8")
    cfg_path = tmp_path / "fp8" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["block_size"] = [2**64 + 32, 2**64 + 32]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="block_size"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")


@pytest.mark.skipif(cpu_kernel.active_path() is None, reason="no C CPU kernel here")
@pytest.mark.parametrize("huge", HUGE)
def test_the_c_calls_refuse_block_sizes_that_would_wrap(huge) -> None:
    w = torch.randint(0, 100, (64, 64), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.ones(1)
    with pytest.raises(ValueError, match="block size"):
        cpu_kernel.decode(w, scale, "block", (huge, huge), torch.float32)
    x = torch.randn(5, 64)
    with pytest.raises(ValueError, match="activation"):
        cpu_kernel.quantize_activation(
            x, None, torch.float8_e4m3fn, "block", huge, torch.float32, True,
            cpu_kernel.active_path(),
        )  # fmt: skip
