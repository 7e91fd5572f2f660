"""A linear shared under two names (``layers[1].mlp.down_proj = layers[0].mlp.down_proj``) is one
module with one input scale. ``activation_scales`` keyed by its second name was silently
ignored: the first name's fallback won (0.02 instead of the 0.5 asked for), and two keys with
different values kept the first one's (reviewer R27 F3). Now the one explicit key applies
(whichever name it uses: it names exactly this module), equal keys agree, and different values
are refused, naming both keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from tests.tiny_models import TINY

FIRST = "model.layers.0.mlp.down_proj"
ALIAS = "model.layers.1.mlp.down_proj"


def _shared_llama() -> nn.Module:
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    model.model.layers[1].mlp.down_proj = model.model.layers[0].mlp.down_proj
    return model


def _scale(model, name: str) -> float:
    layer = model.get_submodule(name)
    assert isinstance(layer, Fp8Linear)
    return float(layer.input_scale)


def test_scale_keyed_by_the_second_name_applies():
    model = quantize_model(
        _shared_llama(), Fp8Config("static", activation_scale=0.02, activation_scales={ALIAS: 0.5})
    )
    assert model.get_submodule(ALIAS) is model.get_submodule(FIRST)  # still shared
    assert _scale(model, ALIAS) == 0.5
    assert _scale(model, "model.layers.0.mlp.up_proj") == pytest.approx(0.02)  # others: fallback


def test_scale_keyed_by_the_second_name_without_fallback_applies():
    model = quantize_model(_shared_llama(), Fp8Config("static", activation_scales={ALIAS: 0.5}))
    assert _scale(model, FIRST) == 0.5


def test_equal_scales_under_both_names_apply():
    config = Fp8Config("static", activation_scales={FIRST: 0.25, ALIAS: 0.25})
    model = quantize_model(_shared_llama(), config)
    assert _scale(model, FIRST) == 0.25


def test_different_scales_under_both_names_are_refused_and_nothing_converts():
    model = _shared_llama()
    config = Fp8Config("static", activation_scales={FIRST: 0.001, ALIAS: 0.5})
    with pytest.raises(ValueError, match="shared") as err:
        quantize_model(model, config)
    assert FIRST in str(err.value) and ALIAS in str(err.value)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


# -- MoE experts shared under two names: the same rule per projection --------------------------
EXPERTS = "model.layers.{}.mlp.experts"


def _shared_moe() -> nn.Module:
    from tests.serialization.moe_fixtures import tiny_qwen3_moe

    model = tiny_qwen3_moe()
    model.model.layers[1].mlp.experts = model.model.layers[0].mlp.experts
    return model


def _experts_swaps(config: Fp8Config):
    from hf_fp8.modules.replace import _build_experts
    from hf_fp8.quantizer.experts import experts_to_convert

    model = _shared_moe()
    return _build_experts(config, experts_to_convert(model, skip=["lm_head"]))


def test_experts_scale_keyed_by_the_second_name_applies():
    key = f"{EXPERTS.format(1)}.down_proj"
    swaps = _experts_swaps(Fp8Config("static", activation_scale=0.02, activation_scales={key: 0.5}))
    assert len(swaps) == 2 and swaps[0][2] is swaps[1][2]  # converted once, still shared
    experts = swaps[0][2]
    assert torch.equal(experts.down_proj_input_scale, torch.full((experts.num_experts,), 0.5))
    assert torch.equal(experts.gate_up_proj_input_scale, torch.full((experts.num_experts,), 0.02))


def test_experts_different_scales_under_both_names_are_refused():
    first, alias = (f"{EXPERTS.format(i)}.down_proj" for i in (0, 1))
    with pytest.raises(ValueError, match="shared") as err:
        _experts_swaps(Fp8Config("static", activation_scales={first: 0.001, alias: 0.5}))
    assert first in str(err.value) and alias in str(err.value)


# -- the call sites outside hf_fp8/modules: quantize_model's experts and from_pretrained


def test_quantize_model_shared_experts_take_the_second_names_scale():
    key = f"{EXPERTS.format(1)}.down_proj"
    model = quantize_model(
        _shared_moe(),
        Fp8Config("static", activation_scale=0.02, activation_scales={key: 0.5}),
        skip=["lm_head"],
    )
    experts = model.get_submodule(EXPERTS.format(1))
    assert torch.equal(experts.down_proj_input_scale, torch.full((experts.num_experts,), 0.5))


def test_from_pretrained_shared_linear_takes_the_second_names_scale(tmp_path):
    import transformers as tf

    class SharedLlama(tf.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.model.layers[1].mlp.down_proj = self.model.layers[0].mlp.down_proj

    config_cls, _, kwargs = TINY["llama"]
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config_cls(**kwargs)).save_pretrained(tmp_path)  # nothing shared on disk
    model = SharedLlama.from_pretrained(
        tmp_path,
        quantization_config=Fp8Config(
            "static", activation_scale=0.02, activation_scales={ALIAS: 0.5}
        ),
    )
    assert model.get_submodule(ALIAS) is model.get_submodule(FIRST)
    assert _scale(model, ALIAS) == 0.5
