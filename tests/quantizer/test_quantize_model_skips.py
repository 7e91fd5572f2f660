"""``quantize_model`` keeps what ``from_pretrained(..., quantization_config=Fp8Config())``
keeps on a transformers model: tied weights, the output embeddings, the last module and
``_keep_in_fp32_modules`` (the quantizer's own default skips, not a copy of them).

Before, it converted all of them: a tied ``lm_head`` became FP8 (the tie broken; the saved
checkpoint failed to reload in ``tie_weights``), T5's ``wo`` was converted and the forward
crashed, and the README's LoRA merge-then-requantize flow quantized ``lm_head``.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.bitwise import assert_states_bit_equal
from tests.tiny_models import TINY, model_inputs, model_output


def _build(family: str, **overrides) -> nn.Module:
    config_cls, model_cls, kwargs = TINY[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**kwargs, **overrides})).eval()


def _fp8_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _dequantized(model: nn.Module) -> nn.Module:
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.dequantize())
    return model


def test_tied_output_layer_is_kept_and_the_checkpoint_reloads(tmp_path) -> None:
    model = hf_fp8.quantize_model(_build("llama", tie_word_embeddings=True), Fp8Config("dynamic"))
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert_states_bit_equal(model, reloaded)
    inputs = model_inputs("llama")
    with torch.no_grad():
        assert torch.equal(model_output(reloaded, inputs), model_output(model, inputs))


def test_same_layers_as_from_pretrained(tiny_model_dir) -> None:
    """The reference is the quantizer's own selection, through ``from_pretrained``."""
    path = tiny_model_dir("llama")
    loaded = AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config())
    converted = hf_fp8.quantize_model(AutoModelForCausalLM.from_pretrained(path), Fp8Config())
    assert _fp8_names(converted) == _fp8_names(loaded)
    assert type(converted.lm_head) is nn.Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_keeps_wo_and_runs(dtype) -> None:
    model = _build("t5").to(dtype)
    hf_fp8.quantize_model(model, Fp8Config("weight_only"))
    assert {type(m) for n, m in model.named_modules() if n.endswith(".wo")} == {nn.Linear}
    assert type(model.lm_head) is nn.Linear
    inputs = model_inputs("t5")
    with torch.no_grad():
        got = model_output(model, inputs)
        want = model_output(_dequantized(model), inputs)
    assert float((got - want).norm() / want.norm()) < (0.02 if dtype == torch.bfloat16 else 1e-4)


def test_lora_merge_then_requantize_keeps_the_output_layer(tiny_model_dir, tmp_path) -> None:
    path = tiny_model_dir("llama", torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config("dynamic"))
    peft_model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    merged = peft_model.merge_and_unload()
    requantized = hf_fp8.quantize_model(merged, Fp8Config("dynamic"))
    assert type(requantized.lm_head) is nn.Linear
    assert _fp8_names(requantized) == _fp8_names(
        AutoModelForCausalLM.from_pretrained(path, quantization_config=Fp8Config("dynamic"))
    )
    requantized.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "lm_head" in saved.config.quantization_config.modules_to_not_convert
    assert_states_bit_equal(requantized, saved)


def test_default_skips_off_converts_an_untied_output_layer() -> None:
    model = hf_fp8.quantize_model(_build("llama"), Fp8Config(), default_skips=False)
    assert isinstance(model.lm_head, Fp8Linear)


def test_tied_layer_is_refused_without_default_skips() -> None:
    model = _build("llama", tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"lm_head.*model\.embed_tokens.*skip=\['lm_head'\]"):
        hf_fp8.quantize_model(model, Fp8Config(), default_skips=False)
    assert not _fp8_names(model)  # refused before anything converted


def test_shared_weight_of_a_plain_module_is_refused() -> None:
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16), nn.Linear(8, 16))
    model[2].weight = model[0].weight  # tied by hand: [16, 8] both
    with pytest.raises(ValueError, match=r"2\.weight.*0\.weight"):
        hf_fp8.quantize_model(model, Fp8Config())
    hf_fp8.quantize_model(model, Fp8Config(), skip=["2"])
    assert isinstance(model[1], Fp8Linear) and model[2].weight is model[0].weight
