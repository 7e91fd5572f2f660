"""R31 F1: ``resize_token_embeddings`` of a model whose ``lm_head`` is an ``Fp8Linear``
(``quantize_model(..., default_skips=False)``, or the reload of such a checkpoint) crashed in
torch (``"check_uniform_bounds" not implemented for 'Float8_e4m3fn'``: transformers builds an
fp8 ``nn.Linear``) after the input embeddings were already resized, and would have copied fp8
codes without their scales. It is now refused before anything changes, naming the fix.

References: the model before the call (nothing may change), and the high-precision model
resized with the same arguments and seed (an FP8 model whose head stays in high precision, a
tied one included, resizes as it does)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import TINY, VOCAB, model_inputs


def _llama(**over):
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**kwargs, **over})).eval()


def _fp8_head_llama():
    model = hf_fp8.quantize_model(_llama(), Fp8Config("dynamic"), default_skips=False)
    assert isinstance(model.lm_head, Fp8Linear)
    return model


def _snapshot(model) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "embed": model.get_input_embeddings(),
        "head": model.get_output_embeddings(),
        "vocab": model.config.vocab_size,
    }


def _assert_unchanged(model, before: dict) -> None:
    assert model.get_input_embeddings() is before["embed"]
    assert model.get_output_embeddings() is before["head"]
    assert model.config.vocab_size == before["vocab"]
    after = model.state_dict()
    assert after.keys() == before["tensors"].keys()
    for key, value in before["tensors"].items():
        assert after[key].dtype == value.dtype, key
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize(
    "kwargs",
    [
        {"new_num_tokens": 160},
        {"new_num_tokens": 160, "mean_resizing": False},
        {"new_num_tokens": 96},  # shrinking
        {"pad_to_multiple_of": 96},  # 128 -> 192
    ],
)
def test_resizing_an_fp8_head_is_refused_before_anything_changes(kwargs):
    model = _fp8_head_llama()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="lm_head, an FP8 layer") as err:
        model.resize_token_embeddings(**kwargs)
    message = str(err.value)
    assert "before quantizing" in message
    assert "modules_to_not_convert=['lm_head']" in message
    assert "Nothing was changed" in message
    _assert_unchanged(model, before)


def test_reloaded_fp8_head_checkpoint_is_refused_too(tmp_path):
    _fp8_head_llama().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model.lm_head, Fp8Linear)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="lm_head, an FP8 layer"):
        model.resize_token_embeddings(VOCAB + 32, 8)  # positional, as subclasses call it
    _assert_unchanged(model, before)


@pytest.mark.parametrize(
    "kwargs", [{}, {"new_num_tokens": VOCAB}, {"pad_to_multiple_of": 64}, {"new_num_tokens": None}]
)
def test_a_resize_to_the_same_size_goes_through(kwargs):
    """As on the float model: the embeddings are returned, the FP8 head is kept."""
    model = _fp8_head_llama()
    inputs = model_inputs("llama")
    with torch.no_grad():
        ref = model(**inputs).logits
    embeddings = model.resize_token_embeddings(**kwargs)
    assert embeddings is model.get_input_embeddings()
    assert embeddings.weight.shape[0] == VOCAB
    assert isinstance(model.lm_head, Fp8Linear)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, ref)


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_model_with_a_high_precision_head_resizes_as_the_float_model(tied):
    reference = _llama(tie_word_embeddings=tied)
    model = hf_fp8.quantize_model(copy.deepcopy(reference), Fp8Config("dynamic"))
    assert not isinstance(model.lm_head, Fp8Linear)  # the default skip
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), Fp8Linear)
    for m in (reference, model):
        torch.manual_seed(1)
        m.resize_token_embeddings(VOCAB + 32, mean_resizing=False)
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        got, want = getattr(model, getter)().weight, getattr(reference, getter)().weight
        assert got.shape == want.shape == (VOCAB + 32, 64), getter
        assert torch.equal(got, want), getter
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.vocab_size == reference.config.vocab_size == VOCAB + 32


def test_a_tied_head_cannot_become_fp8():
    """What happens with a tied FP8 head: it cannot be made (the tie would break), so the
    resize of a tied model always takes the float path above."""
    with pytest.raises(ValueError, match="tied"):
        hf_fp8.quantize_model(
            _llama(tie_word_embeddings=True), Fp8Config("dynamic"), default_skips=False
        )


def test_patch_survives_reload_and_is_reported_on():
    from transformers import PreTrainedModel

    from hf_fp8 import patches

    module = importlib.import_module("hf_fp8.patches.resize_embeddings")
    wrapper = PreTrainedModel.__dict__["resize_token_embeddings"]
    assert getattr(wrapper, "_hf_fp8", False)
    importlib.reload(module)
    assert patches.apply("resize_embeddings", strict=True)
    assert PreTrainedModel.__dict__["resize_token_embeddings"] is wrapper  # not wrapped twice
    assert patches.status()["resize_embeddings"] == "on"
    model = _fp8_head_llama()
    with pytest.raises(ValueError, match="lm_head, an FP8 layer"):
        model.resize_token_embeddings(VOCAB + 32)
