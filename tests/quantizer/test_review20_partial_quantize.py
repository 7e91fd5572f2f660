"""A ``quantize_model`` that raises leaves the model as it was (reviewer R20 F6).

The layers were swapped one by one: a non-finite weight in a later layer (or Ctrl-C) raised
after the earlier ones were already ``Fp8Linear``, on a model without ``quantization_config``
whose ``save_pretrained`` wrote a checkpoint every reload refused. References: the module
objects and the high-precision state dict the model held before the call.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import hf_fp8
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.quantizer import convert
from tests.tiny_models import DECODER_SIZES

SIZES = DECODER_SIZES


def _llama() -> tf.PreTrainedModel:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=128, **SIZES))


def _moe() -> tf.PreTrainedModel:
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **SIZES)
    return tf.Qwen3MoeForCausalLM(cfg)


def _before(model) -> tuple[dict, dict]:
    modules = {name: m for name, m in model.named_modules()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return modules, state


def _assert_unchanged(model, before) -> None:
    modules, state = before
    now = dict(model.named_modules())
    assert now.keys() == modules.keys()
    for name, module in now.items():
        assert module is modules[name], f"{name} was replaced"
    assert not any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())
    now_state = model.state_dict()
    assert now_state.keys() == state.keys()
    for key, value in state.items():
        assert now_state[key].dtype == value.dtype
        torch.testing.assert_close(now_state[key], value, rtol=0, atol=0, equal_nan=True)
    assert getattr(model.config, "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)


def _poison(model, fragment: str) -> None:
    """NaN into the last parameter whose name holds ``fragment`` (a late layer)."""
    param = [p for n, p in model.named_parameters() if fragment in n][-1]
    with torch.no_grad():
        param.view(-1)[0] = float("nan")


@pytest.mark.parametrize(
    ("make", "fragment"),
    [(_llama, "layers.1.mlp.down_proj"), (_moe, "layers.1.mlp.experts")],
    ids=["linear", "experts"],
)
def test_a_non_finite_late_weight_leaves_the_model_unchanged(make, fragment) -> None:
    model = make()
    _poison(model, fragment)
    before = _before(model)
    with pytest.raises(ValueError, match="non-finite"):
        hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"))
    _assert_unchanged(model, before)


def test_after_a_refusal_the_fixed_model_quantizes() -> None:
    model, ref = _llama(), _llama()
    param = [p for n, p in model.named_parameters() if "layers.1.mlp.down_proj" in n][-1]
    with torch.no_grad():
        good = param.view(-1)[0].item()
        param.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"))
    with torch.no_grad():
        param.view(-1)[0] = good
    hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"))
    hf_fp8.quantize_model(ref, hf_fp8.Fp8Config("dynamic"))
    names = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert names == {n for n, m in ref.named_modules() if isinstance(m, Fp8Linear)}
    assert len(names) == 14
    assert model.config.quantization_config is not None
    x = torch.arange(1, 9)[None]
    torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=0)


def _interrupt_on_call(n: int, real):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("where", ["from_linear", "from_experts", "mark_origin"])
def test_ctrl_c_during_quantize_model_leaves_the_model_unchanged(monkeypatch, where) -> None:
    """KeyboardInterrupt while layers convert (the 5th linear, the 2nd experts) or while the
    converted model is marked (every layer built and swapped): the original model is back."""
    model = _moe() if where == "from_experts" else _llama()
    before = _before(model)
    if where == "from_linear":
        real = Fp8Linear.from_linear.__func__
        monkeypatch.setattr(Fp8Linear, "from_linear", classmethod(_interrupt_on_call(5, real)))
    elif where == "from_experts":
        real = Fp8Experts.from_experts.__func__
        monkeypatch.setattr(Fp8Experts, "from_experts", classmethod(_interrupt_on_call(2, real)))
    else:
        monkeypatch.setattr(convert, "mark_origin", _interrupt_on_call(1, convert.mark_origin))
    with pytest.raises(KeyboardInterrupt):
        hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"))
    _assert_unchanged(model, before)
