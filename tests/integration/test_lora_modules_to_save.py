"""peft's fully trained extra modules (``modules_to_save``, ``trainable_token_indices``) on an
FP8 model: refused at ``get_peft_model`` on FP8 layers (found by R8: the copy's fp8 codes
trained nothing, silently, once ``freeze_fp8`` was called as the forward error advised); on
high-precision layers (a kept ``lm_head``, a classifier head) they train as without FP8."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from peft import LoraConfig, PeftModel, TrainableTokensConfig, get_peft_model

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from tests.tiny_models import LLAMA_ONE_LAYER, model_inputs

_CONFIG = {**LLAMA_ONE_LAYER, "pad_token_id": 0}


def _llama(cls=tf.LlamaForCausalLM, scheme="dynamic", *, fp8_heads=False):
    """A tiny Llama quantized to FP8; ``fp8_heads`` converts the output head too."""
    torch.manual_seed(0)
    model = cls(tf.LlamaConfig(**_CONFIG))
    return quantize_model(model, Fp8Config(scheme), default_skips=not fp8_heads)


def _fix_named(err: pytest.ExceptionInfo, what: str, name: str) -> None:
    message = str(err.value)
    assert what in message and name in message
    assert "skip=" in message  # no Fp8Config load route with default_skips=False (R18 F3)
    assert "target_modules" in message


@pytest.mark.parametrize(
    ("modules_to_save", "named"),
    [
        (["o_proj"], "model.layers.0.self_attn.o_proj"),  # R8's case
        (["self_attn"], "model.layers.0.self_attn, which holds FP8 layers (q_proj"),  # a block
    ],
)
def test_modules_to_save_on_an_fp8_layer_is_refused_with_the_fix(modules_to_save, named):
    # (peft leaves LoRA targets inside a module to save alone: gate_proj gets the adapter)
    config = LoraConfig(
        r=4, target_modules=["q_proj", "gate_proj"], modules_to_save=modules_to_save
    )
    with pytest.raises(ValueError, match=r"modules_to_save.*FP8") as err:
        get_peft_model(_llama(), config)
    _fix_named(err, "modules_to_save", named)
    assert f"modules_to_not_convert=[{modules_to_save[0]!r}]" in str(err.value)
    leaves = "['o_proj']" if modules_to_save == ["o_proj"] else "['q_proj', 'k_proj', 'v_proj'"
    assert f"target_modules={leaves}" in str(err.value)


def test_modules_to_save_on_an_fp8_lm_head_and_classifier_is_refused():
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"modules_to_save.*lm_head.*FP8") as err:
        get_peft_model(_llama(fp8_heads=True), config)
    _fix_named(err, "modules_to_save", "lm_head")
    # SEQ_CLS adds the classifier head ("score") to modules_to_save itself
    model = _llama(tf.LlamaForSequenceClassification, fp8_heads=True)
    assert isinstance(model.score, Fp8Linear)
    with pytest.raises(ValueError, match=r"modules_to_save.*score.*FP8"):
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS"))


def test_trainable_token_indices_on_an_fp8_lm_head_is_refused_with_the_fix():
    """peft failed in the first forward (``index_copy`` of fp8), naming nothing."""
    config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices={"lm_head": [1]})
    with pytest.raises(ValueError, match=r"trainable_token_indices.*lm_head.*FP8") as err:
        get_peft_model(_llama(fp8_heads=True), config)
    _fix_named(err, "trainable_token_indices", "lm_head")


@pytest.mark.parametrize("target", ["lm_head", "o_proj"])
def test_trainable_tokens_method_on_an_fp8_layer_is_refused_with_the_fix(target):
    """peft's standalone trainable-tokens method (TrainableTokensConfig) made fp8 token rows
    trainable and failed in the first forward (``index_copy`` of fp8), naming nothing."""
    config = TrainableTokensConfig(target_modules=[target], token_indices=[1, 2])
    with pytest.raises(ValueError, match=rf"TrainableTokensConfig.*{target}.*FP8") as err:
        get_peft_model(_llama(fp8_heads=True), config)
    _fix_named(err, "TrainableTokensConfig", target)


def test_modules_to_save_on_fp8_experts_is_refused():
    from tests.serialization.moe_fixtures import tiny_qwen3_moe

    model = quantize_model(tiny_qwen3_moe(), Fp8Config(), skip=["lm_head"])
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["experts"])
    with pytest.raises(ValueError, match=r"modules_to_save.*FP8 layer \(Fp8Experts\)") as err:
        get_peft_model(model, config)
    assert "modules_to_not_convert=" in str(err.value)
    assert "target_modules=['q_proj'" in str(err.value)  # LoRA around the experts


def test_adapter_with_modules_to_save_loaded_onto_an_fp8_layer_is_refused(tmp_path):
    """Loading would copy the saved high-precision weight into fp8 codes without a scale."""
    torch.manual_seed(0)
    high = tf.LlamaForCausalLM(tf.LlamaConfig(**_CONFIG))
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj"])
    get_peft_model(high, config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"modules_to_save.*o_proj.*FP8"):
        PeftModel.from_pretrained(_llama(), tmp_path)


def test_frozen_error_names_modules_to_save():
    """The forward error of a trainable FP8 copy names modules_to_save as a cause and the
    fixes (for copies made some other way, or with the peft patch off)."""
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32), Fp8Config("dynamic"), module_name="o")
    trainable = copy.deepcopy(layer).requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"o\.weight has requires_grad=True") as err:
        trainable(torch.randn(2, 64))
    message = str(err.value)
    assert "modules_to_save" in message and "modules_to_not_convert" in message
    assert "freeze_fp8" in message and "target_modules" in message


def _train(model, labels, steps=3):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    batch = model_inputs("llama")
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    ("cls", "head", "task_type"),
    [
        (tf.LlamaForCausalLM, "lm_head", None),
        (tf.LlamaForSequenceClassification, "score", "SEQ_CLS"),
    ],
    ids=["lm_head", "classifier"],
)
def test_modules_to_save_of_a_high_precision_head_trains_as_without_fp8(cls, head, task_type):
    """The head kept in high precision trains through modules_to_save; its trained copy
    matches the same run on the dequantized model (weight-only: same products)."""
    fp8 = _llama(cls, "weight_only")
    assert not isinstance(getattr(fp8, head), Fp8Linear)
    dense = copy.deepcopy(fp8).dequantize()
    assert not any(isinstance(m, Fp8Linear) for m in dense.modules())
    labels = model_inputs("llama")["input_ids"] if task_type is None else torch.tensor([0, 1])
    copies = []
    for model in (fp8, dense):
        extra = {"modules_to_save": [head]} if task_type is None else {"task_type": task_type}
        config = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False, **extra)
        torch.manual_seed(1)
        peft_model = get_peft_model(model, config)
        wrapper = getattr(peft_model.base_model.model, head)
        before = wrapper.original_module.weight.detach().clone()
        _train(peft_model, labels)
        trained = wrapper.modules_to_save["default"].weight.detach()
        assert not torch.equal(trained, before)  # the head copy trained
        assert torch.equal(wrapper.original_module.weight, before)  # the original did not
        copies.append(trained - before)
    torch.testing.assert_close(copies[0], copies[1], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("method", ["trainable_token_indices", "TrainableTokensConfig"])
def test_trainable_tokens_of_the_high_precision_embedding_train_as_without_fp8(method):
    """Token rows of the embedding (never FP8) train as on the dequantized model."""
    fp8 = _llama(scheme="weight_only")
    dense = copy.deepcopy(fp8).dequantize()
    labels = model_inputs("llama")["input_ids"]
    deltas = []
    for model in (fp8, dense):
        if method == "TrainableTokensConfig":
            config = TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[3, 5])
        else:
            config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5])
        torch.manual_seed(1)
        peft_model = get_peft_model(model, config)
        embed = peft_model.base_model.model.model.embed_tokens
        layer = getattr(embed, "token_adapter", embed)
        before = layer.trainable_tokens_delta["default"].detach().clone()
        _train(peft_model, labels)
        delta = layer.trainable_tokens_delta["default"].detach() - before
        assert delta.abs().sum() > 0
        deltas.append(delta)
    torch.testing.assert_close(deltas[0], deltas[1], rtol=1e-3, atol=1e-5)


def test_patch_status_stays_on():
    assert hf_fp8.patches.status()["peft_lora"] == "on"


@pytest.mark.slow
def test_missing_peft_wrapper_api_turns_only_the_check_off():
    """The check fails alone: LoRA (and its merge registration) keeps working, one warning."""
    from tests.patches.helpers import check, patch_warnings, run_python

    result = run_python(
        """
        import hf_fp8.patches.peft_lora as patch  # before peft: the patch waits for it
        patch.WRAPPERS = "peft.utils.moved"  # as if peft moved AuxiliaryTrainingWrapper
        import hf_fp8, torch
        from peft import LoraConfig, get_peft_model
        from tests.tiny_models import TINY
        config_cls, model_cls, kwargs = TINY["llama"]
        model = hf_fp8.quantize_model(model_cls(config_cls(**kwargs)), hf_fp8.Fp8Config())
        config = LoraConfig(r=4, target_modules=["q_proj"])
        layer = get_peft_model(model, config).base_model.model.model.layers[0].self_attn.q_proj
        print(type(layer).__name__, hf_fp8.patches.status()["peft_lora"])
        """
    )
    out = check(result)
    (warning,) = patch_warnings(result.stderr)
    assert "partly disabled" in warning and "modules_to_save" in warning
    assert out.startswith("Fp8LoraLinear partly off: ")
