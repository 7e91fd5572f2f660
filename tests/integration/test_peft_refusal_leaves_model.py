"""A peft configuration refused on an FP8 model leaves the model exactly as it was.

Found as a known gap: hf_fp8 refused some configurations only when peft reached them in the
middle of ``get_peft_model`` (``modules_to_save`` and trainable tokens after the LoRA layers were
injected and every base parameter frozen; LoRA on FP8 experts and rewriting inits at their
target, after the targets ahead of it; TrainableTokensConfig at its FP8 target). The targets
handled before stayed wrapped, ``requires_grad`` stayed changed, and a PiSSA init had already
rewritten a high-precision target's weight: retrying with the fixed config, or using the model
without adapters, behaved differently than on a fresh model. Each case here builds the model,
keeps an untouched deep copy, has the refusal raised, checks the refusal still names its fix,
compares the model with the copy (module tree, state dict bits, requires_grad, training flags,
attributes, logits bit for bit) and retries the fixed config on both: same adapter, same logits.
The refusals come before peft changes anything (``hf_fp8.peft_preflight``: checked here with the
rollback turned off); where a refusal still comes at its target (the early look turned off), the
``peft_lora`` patch restores the model (``hf_fp8.peft_rollback``: checked with the early look off).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from peft import (
    IA3Config,
    KasaConfig,
    LoraConfig,
    PeftModel,
    TrainableTokensConfig,
    get_peft_model,
)

from hf_fp8 import Fp8Config, quantize_model
from tests.tiny_models import LLAMA_ONE_LAYER, model_inputs


def _llama(cls=tf.LlamaForCausalLM, *, skip=None, fp8_heads=False, train=False):
    torch.manual_seed(0)
    model = cls(tf.LlamaConfig(**LLAMA_ONE_LAYER, pad_token_id=0))
    model = quantize_model(model, Fp8Config("dynamic"), skip=skip, default_skips=not fp8_heads)
    return model.train(train)


def _moe():
    from tests.serialization.moe_fixtures import tiny_qwen3_moe

    return quantize_model(tiny_qwen3_moe(), Fp8Config(), skip=["lm_head"])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _inputs(model) -> dict:
    batch = model_inputs("llama")
    if model.config.model_type == "qwen3_moe":
        batch = {k: v % model.config.vocab_size for k, v in batch.items()}
    return batch


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**_inputs(model)).logits


def assert_untouched(model, reference) -> None:
    """``model`` equals ``reference`` (a deep copy made before the refusal): same module tree
    and types, same state dict bit for bit, same requires_grad and training flags, same
    instance attributes, same logits bit for bit."""
    tree = [(n, type(m)) for n, m in model.named_modules()]
    assert tree == [(n, type(m)) for n, m in reference.named_modules()]
    assert not any(type(m).__module__.startswith("peft") for _, m in model.named_modules())
    state, ref_state = model.state_dict(), reference.state_dict()
    assert state.keys() == ref_state.keys()
    for key, value in state.items():
        assert value.dtype == ref_state[key].dtype, key
        assert torch.equal(_bits(value), _bits(ref_state[key])), key
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    assert grads == {n: p.requires_grad for n, p in reference.named_parameters()}
    assert [m.training for m in model.modules()] == [m.training for m in reference.modules()]
    for module, ref in zip(model.modules(), reference.modules(), strict=True):
        assert module.__dict__.keys() == ref.__dict__.keys(), type(module).__name__
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            assert len(getattr(module, hooks)) == len(getattr(ref, hooks))
    assert model.config.to_dict() == reference.config.to_dict()
    assert torch.equal(_logits(model), _logits(reference))


def assert_retry_as_fresh(model, reference, config) -> None:
    """The fixed ``config`` on the refused model gives what it gives on the fresh copy."""
    results = []
    for base in (model, reference):
        torch.manual_seed(1)
        peft_model = get_peft_model(base, copy.deepcopy(config))
        with torch.no_grad():
            for name, param in sorted(peft_model.named_parameters()):
                if "lora_B" in name:
                    param.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
        results.append((peft_model.state_dict(), trainable, _logits(peft_model)))
    (state, trainable, logits), (ref_state, ref_trainable, ref_logits) = results
    assert trainable == ref_trainable and trainable
    assert state.keys() == ref_state.keys()
    for key, value in state.items():
        assert torch.equal(_bits(value), _bits(ref_state[key])), key
    assert torch.equal(logits, ref_logits)


def _refused(model, config, error, match, **kwargs) -> pytest.ExceptionInfo:
    reference = copy.deepcopy(model)
    with pytest.raises(error, match=match) as err:
        get_peft_model(model, config, **kwargs)
    assert_untouched(model, reference)
    return err, reference


@pytest.fixture
def no_rollback(monkeypatch):
    """The refusal must come before peft changes the model: nothing is put back."""
    monkeypatch.setattr("hf_fp8.peft_rollback.ModelSnapshot.restore", lambda self: None)


@pytest.fixture
def no_early_look(monkeypatch):
    """The refusal comes where peft reaches the target: the patch must put the model back."""
    monkeypatch.setattr("hf_fp8.peft_preflight.check_before_injection", lambda *a, **k: None)


LORA_FIX = LoraConfig(r=4, target_modules=["q_proj", "o_proj"])

CASES = {
    # LoRA injected on q_proj and every base parameter frozen before modules_to_save was reached
    "modules_to_save": (
        dict(),
        LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj"]),
        ValueError,
        r"modules_to_save names model\.layers\.0\.self_attn\.o_proj, an FP8 layer",
        ["modules_to_not_convert=['o_proj']", "LoraConfig(target_modules=['o_proj'])"],
        LORA_FIX,
    ),
    "modules_to_save-block": (
        dict(),
        LoraConfig(r=4, target_modules=["q_proj", "gate_proj"], modules_to_save=["self_attn"]),
        ValueError,
        r"modules_to_save names model\.layers\.0\.self_attn, which holds FP8 layers",
        ["modules_to_not_convert=['self_attn']", "target_modules=['q_proj', 'k_proj'"],
        LoraConfig(r=4, target_modules=["q_proj", "gate_proj"]),
    ),
    "trainable_token_indices": (
        dict(fp8_heads=True),
        LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices={"lm_head": [1]}),
        ValueError,
        r"trainable_token_indices names lm_head, an FP8 layer",
        ["skip=['lm_head'], default_skips=False", "target_modules=['lm_head']"],
        LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
    ),
    # the high-precision embedding got its token adapter before the FP8 lm_head was reached
    "TrainableTokensConfig": (
        dict(fp8_heads=True),
        TrainableTokensConfig(target_modules=["embed_tokens", "lm_head"], token_indices=[1, 2]),
        ValueError,
        r"TrainableTokensConfig target_modules names lm_head, an FP8 layer",
        ["skip=['lm_head'], default_skips=False", "target_modules=['lm_head']"],
        TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[1, 2]),
    ),
    # PiSSA rewrote the weight of the high-precision q_proj before reaching the FP8 v_proj
    "pissa": (
        dict(skip=["q_proj"]),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa"),
        ValueError,
        r"rewrites the base weight of model\.layers\.0\.self_attn\.v_proj",
        ["dequantize=True", "hf_fp8.quantize_model(", "init_lora_weights=True"],
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    ),
    "kasa": (
        dict(skip=["q_proj"]),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], kasa_config=KasaConfig()),
        ValueError,
        r"KaSA \(kasa_config\) rewrites the base weight of model\.layers\.0\.self_attn\.v_proj",
        ["dequantize=True", "hf_fp8.quantize_model("],
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    ),
}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", list(CASES))
def test_refused_config_leaves_the_model_as_it_was_and_the_fix_works(case, train, no_rollback):
    build, config, error, match, fixes, fixed = CASES[case]
    config = copy.deepcopy(config)
    model = _llama(**build, train=train)
    err, reference = _refused(model, config, error, match)
    for fix in fixes:
        assert fix in str(err.value), fix
    assert_retry_as_fresh(model, reference, fixed)


# PiSSA and KaSA wrote into the weight of the high-precision target ahead: the rollback puts its
# values back too (hf_fp8.peft_rollback keeps them before peft builds each layer; R15 F2)
AT_TARGET = list(CASES)


@pytest.mark.parametrize("case", AT_TARGET)
def test_a_refusal_at_its_target_leaves_the_model_as_it_was(case, no_early_look):
    build, config, error, match, fixes, fixed = CASES[case]
    model = _llama(**build)
    err, reference = _refused(model, copy.deepcopy(config), error, match)
    for fix in fixes:
        assert fix in str(err.value), fix
    assert_retry_as_fresh(model, reference, fixed)


def test_refused_classifier_head_of_seq_cls_leaves_the_model(no_rollback):
    """SEQ_CLS adds the head (``score``) to modules_to_save itself, after LoRA on q_proj."""
    model = _llama(tf.LlamaForSequenceClassification, fp8_heads=True)
    config = LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS")
    err, _ = _refused(model, config, ValueError, r"modules_to_save names score, an FP8")
    assert "skip=['score'], default_skips=False" in str(err.value)


@pytest.mark.parametrize("early_look", [True, False], ids=["up-front", "at-target"])
@pytest.mark.parametrize(
    ("config", "named"),
    [
        (dict(target_modules=["q_proj", "experts"]), "experts (peft target_modules)"),
        (
            dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
            "experts.gate_up_proj (peft target_parameters)",  # (was ...gate_up_proj.gate_up_proj)
        ),
    ],
    ids=["target_modules", "target_parameters"],
)
def test_refused_lora_on_fp8_experts_leaves_the_model(config, named, early_look, monkeypatch):
    """The attention's q_proj took LoRA before the experts were reached."""
    off = (
        "peft_rollback.ModelSnapshot.restore"
        if early_look
        else "peft_preflight.check_before_injection"
    )
    monkeypatch.setattr(f"hf_fp8.{off}", lambda *a, **k: None)
    model = _moe()
    err, reference = _refused(
        model, LoraConfig(r=4, **config), NotImplementedError, r"layers\.0\.mlp\.experts"
    )
    assert f"LoRA on model.layers.0.mlp.{named}, FP8 experts" in str(err.value)
    assert "modules_to_not_convert=['experts']" in str(err.value)
    assert "target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']" in str(err.value)
    assert_retry_as_fresh(model, reference, LoraConfig(r=4, target_modules=["q_proj"]))


def test_a_method_refused_at_its_target_leaves_the_model(monkeypatch):
    """Where the early look at a method's targets finds nothing (peft's helpers changed), the
    per-target check refuses after a high-precision target took the method: still untouched."""
    monkeypatch.setattr("hf_fp8.peft_preflight.config_targets", lambda *a, **k: [])
    model = _llama(skip=["q_proj"])
    config = IA3Config(target_modules=["q_proj", "v_proj"], feedforward_modules=[])
    err, reference = _refused(model, config, ValueError, r"peft IA3 .*v_proj, an FP8 layer")
    assert "modules_to_not_convert=['q_proj', 'v_proj']" in str(err.value)
    assert_retry_as_fresh(
        model, reference, IA3Config(target_modules=["q_proj"], feedforward_modules=[])
    )


def test_refused_adapter_load_leaves_the_model(tmp_path, no_rollback):
    """PeftModel.from_pretrained of an adapter saving o_proj, onto an FP8 o_proj."""
    torch.manual_seed(0)
    high = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_ONE_LAYER))
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj"])
    get_peft_model(high, config).save_pretrained(tmp_path)
    model = _llama()
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"modules_to_save.*o_proj.*FP8"):
        PeftModel.from_pretrained(model, tmp_path)
    assert_untouched(model, reference)


@pytest.mark.parametrize("early_look", [True, False], ids=["up-front", "at-target"])
def test_refused_second_adapter_leaves_the_peft_model(early_look, monkeypatch):
    """add_adapter on a PeftModel: the first adapter, its layers and flags stay as they were."""
    model = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    reference = copy.deepcopy(model)
    off = (
        "peft_rollback.ModelSnapshot.restore"
        if early_look
        else "peft_preflight.check_before_injection"
    )
    monkeypatch.setattr(f"hf_fp8.{off}", lambda *a, **k: None)
    bad = LoraConfig(r=4, target_modules=["q_proj", "k_proj"], modules_to_save=["o_proj"])
    with pytest.raises(ValueError, match=r"modules_to_save names .*o_proj, an FP8 layer"):
        model.add_adapter("other", bad)
    inner, ref_inner = model.base_model.model, reference.base_model.model
    assert [(n, type(m)) for n, m in inner.named_modules()] == [
        (n, type(m)) for n, m in ref_inner.named_modules()
    ]
    q_proj = inner.model.layers[0].self_attn.q_proj
    assert set(q_proj.lora_A) == {"default"} and set(q_proj.r) == {"default"}
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {
        n: p.requires_grad for n, p in reference.named_parameters()
    }
    assert list(model.peft_config) == ["default"]
    assert torch.equal(_logits(model), _logits(reference))


def test_peft_own_error_part_way_leaves_the_fp8_model(no_early_look):
    """peft's own refusal of a target it cannot wrap (after q_proj took LoRA) is undone too."""
    model = _llama()
    config = LoraConfig(r=4, target_modules=["q_proj", "rotary_emb"])
    _, reference = _refused(model, config, ValueError, r"LlamaRotaryEmbedding\(\) is not supported")
    assert torch.equal(_logits(model), _logits(reference))
    assert_retry_as_fresh(model, reference, LORA_FIX)


def test_adapter_injected_from_a_state_dict_is_refused_before_any_change(no_rollback):
    """peft's ``inject_adapter_in_model(state_dict=...)`` matches targets by the state dict's
    keys (the high-precision q_proj first): refused before it wraps q_proj."""
    from peft import inject_adapter_in_model

    model = _llama(skip=["q_proj"])
    reference = copy.deepcopy(model)
    prefix = "model.layers.0.self_attn"
    state = {
        f"{prefix}.{n}.ia3_l.default": torch.ones(d, 1) for n, d in (("q_proj", 64), ("v_proj", 32))
    }
    config = IA3Config(target_modules=["q_proj", "v_proj"], feedforward_modules=[])
    with pytest.raises(ValueError, match=r"peft IA3 .*v_proj, an FP8 layer"):
        inject_adapter_in_model(config, model, state_dict=state)
    assert_untouched(model, reference)
