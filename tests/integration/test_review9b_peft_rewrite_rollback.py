"""R15: two ways a refused or failed ``get_peft_model`` on an FP8 model left it changed.

F1: ``target_modules="all-linear"`` on a model with FP8 experts. peft's
``convert_peft_config_for_transformers`` adds the experts to ``target_parameters`` while it
prepares the config; the early look (``hf_fp8.peft_preflight``) read the raw config, so the
experts were refused only when peft reached them, after a PiSSA init had rewritten the
high-precision attention weights (max |dW| 0.044, logits 0.60 off) and after peft had written
its conversion into the user's own ``LoraConfig``.

F2: a base-rewriting init (PiSSA, OLoRA, KaSA) on a high-precision target, then a failure later
in the same pass (peft's own error, or an hf_fp8 refusal at a target the early look cannot see,
e.g. a layer made by ``layer_replication``): the rollback restored the module tree but not the
rewritten weight (q_proj held the PiSSA residual: max |dW| 0.041, logits 7e-3 off).

Each case compares against an untouched deep copy (state dict bit for bit, logits bit for bit)
and checks the user's config object is left as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from peft import KasaConfig, LoraConfig, get_peft_model

from tests.integration.test_peft_refusal_leaves_model import (
    _llama,
    _refused,
    assert_retry_as_fresh,
    assert_untouched,
)


def _fp8_experts_model():
    """Qwen3-MoE with FP8 experts and high-precision attention (the R15 F1 model)."""
    from hf_fp8 import Fp8Config, quantize_model
    from tests.serialization.moe_fixtures import tiny_qwen3_moe

    return quantize_model(tiny_qwen3_moe(), Fp8Config(), skip=["lm_head", "self_attn"]).eval()


def _refused_with_config_kept(model, config, error, match):
    before = copy.deepcopy(vars(config))
    err, reference = _refused(model, config, error, match)
    assert vars(config) == before  # neither hf_fp8 nor peft's conversion left a change in it
    return err, reference


@pytest.mark.parametrize("init", ["pissa", "gaussian"])
def test_all_linear_on_fp8_experts_is_refused_before_peft_changes_anything(init, monkeypatch):
    """F1: the early look sees the experts peft adds to ``target_parameters`` for all-linear."""
    monkeypatch.setattr("hf_fp8.peft_rollback.ModelSnapshot.restore", lambda self: None)
    model = _fp8_experts_model()
    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=init)
    err, reference = _refused_with_config_kept(
        model, config, NotImplementedError, r"layers\.0\.mlp\.experts\.gate_up_proj"
    )
    assert "FP8 experts" in str(err.value)
    assert "modules_to_not_convert=['self_attn', 'experts']" in str(err.value)  # own skips + new
    assert_retry_as_fresh(model, reference, LoraConfig(r=4, target_modules=["q_proj"]))


@pytest.mark.parametrize(
    "rewrite",
    [
        dict(init_lora_weights="pissa"),
        dict(init_lora_weights="pissa_niter_2"),
        dict(init_lora_weights="olora"),
        dict(kasa_config=KasaConfig()),
    ],
    ids=["pissa", "pissa_niter", "olora", "kasa"],
)
def test_peft_own_error_after_a_rewriting_init_restores_the_weight(rewrite):
    """F2: q_proj (high precision) took a base-rewriting init, then peft refused rotary_emb."""
    model = _llama(skip=["q_proj", "lm_head"])
    config = LoraConfig(r=4, target_modules=["q_proj", "rotary_emb"], **rewrite)
    _, reference = _refused_with_config_kept(
        model, config, ValueError, r"LlamaRotaryEmbedding\(\) is not supported"
    )
    q = "model.layers.0.self_attn.q_proj.weight"  # the high-precision weight the init rewrote
    assert torch.equal(model.get_parameter(q), reference.get_parameter(q))
    assert_retry_as_fresh(model, reference, LoraConfig(r=4, target_modules=["q_proj"]))


def test_peft_own_error_on_a_moe_model_restores_the_users_config():
    """peft converts a Qwen3-MoE LoraConfig in place (lists become sets): undone with the rest."""
    model = _fp8_experts_model()
    config = LoraConfig(r=4, target_modules=["q_proj", "rotary_emb"], init_lora_weights="pissa")
    targets = list(config.target_modules)
    _, reference = _refused_with_config_kept(model, config, ValueError, r"Qwen3MoeRotaryEmbedding")
    assert sorted(config.target_modules) == sorted(targets)  # peft had made it a set
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.get_parameter(q), reference.get_parameter(q))


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_layer_replication_with_a_rewriting_init_restores_the_shared_weight(init):
    """The replicated layer 2 shares layer 1's weights and is unknown to the early look: PiSSA
    rewrites the shared q_proj there before the FP8 experts of layer 2 are refused."""
    model = _fp8_experts_model()
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "experts"],
        layers_to_transform=[2],
        layers_pattern="layers",
        layer_replication=[[0, 2], [1, 2]],
        init_lora_weights=init,
    )
    err, _ = _refused_with_config_kept(
        model, config, NotImplementedError, r"layers\.2\.mlp\.experts"
    )
    assert "FP8 experts" in str(err.value)
    assert len(model.model.layers) == 2 and model.config.num_hidden_layers == 2


def test_layer_replication_then_peft_error_restores_every_layer():
    """Replication, PiSSA on every (shared) q_proj, then peft's own error: all undone."""
    model = _fp8_experts_model()
    reference = copy.deepcopy(model)
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "rotary_emb"],
        layer_replication=[[0, 2], [0, 2]],
        init_lora_weights="pissa",
    )
    with pytest.raises(ValueError, match="RotaryEmbedding"):
        get_peft_model(model, config)
    assert_untouched(model, reference)


def test_all_linear_with_high_precision_experts_is_not_refused():
    """No false refusal: FP8 attention, high-precision experts. peft wraps what it wraps on the
    high-precision model (experts through ``target_parameters``) and converts the config alike."""
    from hf_fp8 import Fp8Config, quantize_model
    from tests.serialization.moe_fixtures import tiny_qwen3_moe

    results = []
    for fp8 in (True, False):
        model = tiny_qwen3_moe()
        if fp8:
            model = quantize_model(model, Fp8Config(), skip=["lm_head", "experts"])
        config = LoraConfig(r=4, target_modules="all-linear")
        peft_model = get_peft_model(model, config)
        wrapped = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
        results.append((wrapped, vars(config)))
    (wrapped, config), (ref_wrapped, ref_config) = results
    assert any(n.endswith("mlp.experts") for n in wrapped) and wrapped == ref_wrapped
    assert config == ref_config


NOT_REFUSED = {
    "regex": dict(target_modules=r".*\.(q|v)_proj"),
    "exclude_modules": dict(target_modules="all-linear", exclude_modules=["o_proj"]),
    "layers_to_transform": dict(
        target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="layers"
    ),
    "rank_alpha_patterns": dict(
        target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}, alpha_pattern={"q": 3}
    ),
    "dora": dict(target_modules=["q_proj", "v_proj"], use_dora=True),
}


@pytest.mark.parametrize("second", [False, True], ids=["first", "second-adapter"])
@pytest.mark.parametrize("case", list(NOT_REFUSED))
def test_plain_configs_on_fp8_layers_wrap_what_peft_wraps_on_the_high_precision_model(case, second):
    """No false refusal from the prepared config: same wrapped layers and ranks as peft gives on
    the high-precision model (a second adapter added to a PeftModel too)."""
    from hf_fp8 import Fp8Config, quantize_model
    from tests.tiny_models import LLAMA_ONE_LAYER

    results = []
    for fp8 in (True, False):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_ONE_LAYER, pad_token_id=0))
        if fp8:
            model = quantize_model(model, Fp8Config("dynamic"))
        config = LoraConfig(r=4, **NOT_REFUSED[case])
        if second:
            peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["k_proj"]))
            peft_model.add_adapter("other", config)
        else:
            peft_model = get_peft_model(model, config)
        name = "other" if second else "default"
        ranks = {n: m.r[name] for n, m in peft_model.named_modules() if name in getattr(m, "r", {})}
        results.append(ranks)
    assert results[0] == results[1] and results[0]


def test_peft_own_error_after_a_lora_ga_init_restores_the_weight():
    """LoRA-GA (gradients estimated first) subtracts its offset from q_proj's weight too."""
    from peft.tuners.lora.config import LoraGAConfig
    from peft.tuners.lora.loraga import preprocess_loraga

    model = _llama(skip=["q_proj", "lm_head"])
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))

    def config(targets):
        return LoraConfig(
            r=4, target_modules=targets, init_lora_weights="lora_ga", lora_ga_config=LoraGAConfig()
        )

    preprocess_loraga(model, config(["q_proj"]), lambda: model(ids, labels=ids).loss.backward())
    model.zero_grad(set_to_none=True)
    _, reference = _refused_with_config_kept(
        model, config(["q_proj", "rotary_emb"]), ValueError, r"LlamaRotaryEmbedding\(\)"
    )
    q = "model.layers.0.self_attn.q_proj.weight"  # LoRA-GA subtracted its offset here
    assert torch.equal(model.get_parameter(q), reference.get_parameter(q))
