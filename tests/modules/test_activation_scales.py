"""``Fp8Config(activation_scales=...)`` keys checked against the model (review R2 F5): a key that
names no module used to leave its layer silently on the fallback ``activation_scale``."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from torch import nn

from hf_fp8 import Fp8Config, quantize_model
from hf_fp8.modules import (
    Fp8BmmExperts,
    Fp8Experts,
    Fp8Linear,
    Fp8ParallelExperts,
    check_activation_scales,
    convertible_experts,
    convertible_modules,
    scale_keys,
)
from tests.modules.moe_zoo import build_tiny
from tests.modules.test_fp8_experts import _DECODER, FAMILIES, MODELS
from tests.tiny_models import TINY

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.experts.down_proj"


def _llama() -> nn.Module:
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs)).eval()


def _qwen3_moe() -> nn.Module:
    config_name, model_name, extra = MODELS["qwen3_moe"]
    config = getattr(tf, config_name)(**{**_DECODER, **extra})
    return getattr(tf, model_name)(config).eval()


def _targets(model: nn.Module, skip=()) -> list[tuple[str, nn.Module]]:
    linears = [(n, m) for n, m, _ in convertible_modules(model, skip=skip)]
    return linears + [(n, m) for n, m, _ in convertible_experts(model, skip=skip)]


def test_matching_keys_pass_silently() -> None:
    model = _qwen3_moe()
    scales = {Q: 0.01, DOWN: 0.02, "model.layers.0.mlp.experts.gate_up_proj": 0.03}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [check_activation_scales(model, s, _targets(model)) for s in (scales, None, {})]
    assert results == [None, None, None]
    assert [str(w.message) for w in caught] == []


def test_a_typo_is_refused_with_the_close_match() -> None:
    model = _llama()
    scales = {Q: 0.01, "model.layer.0.self_attn.q_proj": 0.001}  # layer, not layers
    with pytest.raises(ValueError) as info:
        check_activation_scales(model, scales, _targets(model))
    message = str(info.value)
    assert "['model.layer.0.self_attn.q_proj'] name no module of LlamaForCausalLM" in message
    assert f"did you mean: 'model.layer.0.self_attn.q_proj' -> {Q!r}?" in message
    assert "would silently get activation_scale" in message and "fix or remove" in message


def test_an_experts_key_must_name_a_projection() -> None:
    model = _qwen3_moe()
    bad = "model.layers.1.mlp.experts.down"
    with pytest.raises(ValueError, match=rf"\['{bad}'\] name no module.*-> '{DOWN}'"):
        check_activation_scales(model, {bad: 0.1}, _targets(model))
    bad = "model.layers.1.mlp.experts"
    with pytest.raises(ValueError, match=rf"name MoE experts.*\['{bad}.down_proj', '{bad}.gate"):
        check_activation_scales(model, {bad: 0.1}, _targets(model))
    with pytest.raises(ValueError, match=r"name no module.*'[^']*q_proj.weight' -> '"):
        check_activation_scales(model, {f"{Q}.weight": 0.1}, _targets(model))


def test_a_key_of_a_module_left_high_precision_warns() -> None:
    model = _qwen3_moe()
    skip = ["lm_head", "model.layers.1.mlp.experts"]
    with pytest.warns(UserWarning, match=r"\['lm_head', '" + DOWN + r"'\].*not converted"):
        check_activation_scales(model, {"lm_head": 0.1, DOWN: 0.1}, _targets(model, skip))


def test_after_the_swap_the_fp8_modules_are_read() -> None:
    model = _qwen3_moe()
    quantize_model(model, Fp8Config("static", activation_scale=0.05))
    assert any(isinstance(m, Fp8Experts) for m in model.modules())
    check_activation_scales(model, {Q: 0.01, DOWN: 0.02})
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.expert.down_proj' -> '"):
        check_activation_scales(model, {"model.layers.1.mlp.expert.down_proj": 0.02})
    with pytest.warns(UserWarning, match=r"\['lm_head'\]"):  # kept by default
        check_activation_scales(model, {"lm_head": 0.02})


def test_scale_keys_of_every_kind_of_layer() -> None:
    from tests.modules.test_fp8_bmm_experts import _moe
    from tests.modules.test_fp8_parallel_experts import _experts

    assert scale_keys("a.q", nn.Linear(4, 4)) == ("a.q",)
    qwen = build_tiny(FAMILIES["Qwen3MoeExperts"])
    assert scale_keys("e", qwen) == ("e.gate_up_proj", "e.down_proj")
    assert scale_keys("e", Fp8Experts.from_experts(qwen)) == ("e.gate_up_proj", "e.down_proj")
    nemotron = build_tiny(FAMILIES["NemotronHExperts"])  # no gate
    assert scale_keys("e", nemotron) == ("e.up_proj", "e.down_proj")
    llama4 = _moe().experts
    assert scale_keys("e", llama4) == ("e.gate_up_proj", "e.down_proj")
    assert scale_keys("e", Fp8BmmExperts.from_experts(llama4)) == scale_keys("e", llama4)
    jet = _experts()
    assert scale_keys("e", jet) == ("e.weight",)
    assert scale_keys("e", Fp8ParallelExperts.from_experts(jet)) == ("e.weight",)


# -- at the swap: both entry points check once per model ---------------------------------------
def test_quantize_model_refuses_a_typo_before_touching_the_model() -> None:
    model = _llama()
    config = Fp8Config("static", activation_scale=0.05, activation_scales={"model.layer.0": 0.1})
    with pytest.raises(ValueError, match=r"'model.layer.0'\] name no module"):
        quantize_model(model, config)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def test_from_pretrained_refuses_a_typo(tmp_path) -> None:
    """The reviewer's repro: the typo'd q_proj got 0.05, not the 0.001 asked for."""
    _llama().save_pretrained(tmp_path)
    config = Fp8Config(
        "static", activation_scale=0.05, activation_scales={"model.layer.0.self_attn.q_proj": 1e-3}
    )
    with pytest.raises(ValueError, match=rf"'model.layer.0.self_attn.q_proj' -> '{Q}'"):
        tf.LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=config)


def test_from_pretrained_applies_matching_keys(tmp_path) -> None:
    """Guard for the call site: correct keys load and reach their layers."""
    _qwen3_moe().save_pretrained(tmp_path)
    config = Fp8Config("static", activation_scale=0.05, activation_scales={Q: 1e-3, DOWN: 2e-3})
    model = tf.Qwen3MoeForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    assert model.model.layers[0].self_attn.q_proj.input_scale.item() == pytest.approx(1e-3)
    assert model.model.layers[0].self_attn.k_proj.input_scale.item() == pytest.approx(0.05)
    experts = model.model.layers[1].mlp.experts
    assert torch.allclose(experts.down_proj_input_scale, torch.tensor(2e-3))
