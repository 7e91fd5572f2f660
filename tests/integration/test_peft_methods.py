"""peft methods other than LoRA on FP8 layers: refused at ``get_peft_model`` with the fix.

Found by HL3/HL4 (tiny Llama, weight-only FP8, adapters perturbed identically on the FP8 model
and on ``model.dequantize()``): IA3, LoHa, LoKr, AdaLoRA, VeRA, FourierFT, MiSS, VB-LoRA,
GraLoRA, C3A, RandLoRA train but ``merge_and_unload`` fails in peft (fp8 promotion / fp8
kernels), naming nothing; OFT, BOFT and HRA merge by rewriting the fp8 codes in place without
their scales (logits off by ~1e-2 on a scale of 0.6 against the dequantized model, silently);
HRA (its forward reads the fp8 codes of ``base_layer.weight`` as numbers), DeFT, FRoD, OSF,
PEANUT (set up from the weight) and PVeRA, UniLoRA (cause not isolated) already differ before
merging (logits off by 6e-3 to 0.97); the forward of the others matches; LN-tuning, SHiRA, HiRA,
DeLoRA, TinyLoRA, AdaMSS, SuperTuning, PSOFT fail in peft's setup on fp8. Every method in
peft's registry is checked here, so a method added to peft is refused until it is verified.
LoRA (``Fp8LoraLinear``) and BEFT (a bias delta, the FP8 layer's bias is high precision) work;
every method still trains layers kept in high precision."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from peft import (
    BeftConfig,
    IA3Config,
    LNTuningConfig,
    LoHaConfig,
    PeftModel,
    get_peft_model,
)
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.tuners.tuners_utils import BaseTuner

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from hf_fp8.peft_trainable import FP8_SAFE_METHODS
from tests.tiny_models import LLAMA_ONE_LAYER, model_inputs

_CONFIG = LLAMA_ONE_LAYER
# what the tiny model needs beyond target_modules (small blocks, sizes that divide 64)
_EXTRA = {
    "ADALORA": dict(total_step=10),
    "BOFT": dict(boft_block_size=4),
    "C3A": dict(block_size=16),
    "FOURIERFT": dict(n_frequency=50),
    "OFT": dict(r=0, oft_block_size=4),
    "ROAD": dict(group_size=16),
    "VBLORA": dict(vector_length=16, num_vectors=16),
    "WAVEFT": dict(n_frequency=50),
}
_TARGETS = ["q_proj", "v_proj"]


def _llama(scheme: str = "weight_only", skip: tuple[str, ...] = (), **config) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**_CONFIG, **config))
    return quantize_model(model, Fp8Config(scheme), skip=list(skip) or None)


def _methods() -> list[str]:
    """Every peft method that injects layers (a tuner with ``target_modules``), but the ones
    that work on FP8 layers (LoRA, BEFT) or have a refusal of their own (trainable tokens);
    prompt-learning methods and adaption prompts wrap no layer of the model."""
    names = []
    for peft_type, config_cls in PEFT_TYPE_TO_CONFIG_MAPPING.items():
        tuner = PEFT_TYPE_TO_TUNER_MAPPING.get(peft_type)
        fields = getattr(config_cls, "__dataclass_fields__", {})
        injects = isinstance(tuner, type) and issubclass(tuner, BaseTuner)
        if not injects or "target_modules" not in fields or peft_type in FP8_SAFE_METHODS:
            continue
        if peft_type.value in ("TRAINABLE_TOKENS", "XLORA"):
            continue  # test_lora_modules_to_save; X-LoRA injects LoRA adapters
        names.append(peft_type.value)
    return names


def _config(method: str, targets=_TARGETS):
    config_cls = next(c for t, c in PEFT_TYPE_TO_CONFIG_MAPPING.items() if t.value == method)
    return config_cls(target_modules=targets, **_EXTRA.get(method, {}))


def test_every_method_outside_lora_is_checked():
    """The registry walk finds the methods of the finding (so no method is skipped silently)."""
    found = set(_methods())
    expected = {"IA3", "LOHA", "LOKR", "ADALORA", "OFT", "BOFT", "HRA", "VERA", "LN_TUNING"}
    assert expected <= found, expected - found
    assert {"FOURIERFT", "MISS", "C3A", "RANDLORA", "SHIRA", "POLY", "VBLORA"} <= found
    assert "LORA" not in found and "BEFT" not in found


@pytest.mark.parametrize("method", _methods())
def test_method_on_fp8_layers_is_refused_with_the_fix(method):
    """Was: accepted (merge failing in peft, or silently wrong), or a failure in peft's setup
    naming no layer. Now: a ValueError naming the layer, the method and the fixes."""
    model = _llama()
    with pytest.raises(ValueError, match=rf"peft {method} \(") as err:
        get_peft_model(model, _config(method))
    message = str(err.value)
    assert "model.layers.0.self_attn.q_proj, an FP8 layer (Fp8Linear)" in message
    assert "LoraConfig(target_modules=['q_proj'])" in message  # LoRA, which hf_fp8 supports
    assert "dequantize=True" in message and "hf_fp8.quantize_model(" in message
    assert "modules_to_not_convert=['q_proj']" in message
    assert not any(type(m).__module__.startswith("peft") for m in model.modules())  # untouched


@pytest.mark.parametrize(
    ("config", "skip"),
    [
        (IA3Config(target_modules=["q_proj", "v_proj"], feedforward_modules=[]), "q_proj"),
        (IA3Config(), "k_proj"),  # peft's default IA3 targets for Llama: k_proj, v_proj, down_proj
        (LoHaConfig(target_modules="all-linear"), ("q_proj", "k_proj")),
    ],
    ids=["list", "peft-defaults", "all-linear"],
)
def test_refusal_comes_before_peft_wraps_any_layer(config, skip):
    """A high-precision target ahead of an FP8 one was wrapped before the refusal, leaving the
    model half converted; now every target is checked first."""
    model = _llama(skip=(skip,) if isinstance(skip, str) else skip)
    with pytest.raises(ValueError, match=r"v_proj, an FP8 layer"):
        get_peft_model(model, config)
    assert not any(type(m).__module__.startswith("peft") for m in model.modules())


def test_method_on_a_block_holding_fp8_layers_is_refused():
    """LN-tuning trains a full copy of the module it targets: a block of FP8 linears too."""
    with pytest.raises(ValueError, match=r"peft LN_TUNING.*self_attn, which holds FP8") as err:
        get_peft_model(_llama(), LNTuningConfig(target_modules=["self_attn"]))
    assert "q_proj" in str(err.value)


def test_saved_adapter_of_another_method_loaded_onto_fp8_layers_is_refused(tmp_path):
    torch.manual_seed(0)
    high = tf.LlamaForCausalLM(tf.LlamaConfig(**_CONFIG))
    config = IA3Config(target_modules=["v_proj", "down_proj"], feedforward_modules=["down_proj"])
    get_peft_model(high, config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"peft IA3 \(IA3Config\).*v_proj, an FP8 layer"):
        PeftModel.from_pretrained(_llama(), tmp_path)


def _perturbed(model, config):
    """``get_peft_model`` with every trainable parameter moved off its (often identity) init,
    the same way on every model."""
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, param in sorted(peft_model.named_parameters()):
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return peft_model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("llama")).logits


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
def test_beft_on_fp8_layers_matches_the_dequantized_model(scheme):
    """BEFT adds a trained bias: forward and merge touch only the FP8 layer's high-precision
    bias, never its fp8 codes; both match BEFT on the dequantized model (fp32, 1e-5; with
    dynamic activations the FP8 products themselves differ from the dense ones, so the FP8
    model with BEFT is compared against the FP8 model with the same bias added by hand)."""
    fp8 = _llama(scheme, attention_bias=True)
    dense = copy.deepcopy(fp8).dequantize()
    q_proj = fp8.model.layers[0].self_attn.q_proj
    codes, bias = q_proj.weight.detach().clone(), q_proj.bias.detach().clone()
    peft_fp8, peft_dense = (
        _perturbed(m, BeftConfig(target_modules=_TARGETS)) for m in (fp8, dense)
    )
    layer = peft_fp8.base_model.model.model.layers[0].self_attn.q_proj
    delta = layer.beft_bias["default"].detach().flatten()
    before = [_logits(peft_fp8), _logits(peft_dense)]
    merged_fp8, merged_dense = peft_fp8.merge_and_unload(), peft_dense.merge_and_unload()
    after = [_logits(merged_fp8), _logits(merged_dense)]
    merged_q = merged_fp8.model.layers[0].self_attn.q_proj
    assert isinstance(merged_q, Fp8Linear) and torch.equal(merged_q.weight, codes)
    torch.testing.assert_close(merged_q.bias, bias + delta, rtol=0, atol=1e-6)
    torch.testing.assert_close(after[0], before[0], rtol=1e-5, atol=1e-5)
    if scheme == "weight_only":  # same products as the dequantized model
        torch.testing.assert_close(before[0], before[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(after[0], after[1], rtol=1e-5, atol=1e-5)
    assert (before[0] - _logits(fp8)).abs().max() == 0  # merge_and_unload left fp8 as merged


def _train(model, steps: int = 3) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    batch = model_inputs("llama")
    for _ in range(steps):
        model(**batch, labels=batch["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in params.items()}


@pytest.mark.parametrize(
    ("config", "skip"),
    [
        (LoHaConfig(r=4, target_modules=["lm_head"], init_weights=False), ()),
        (IA3Config(target_modules=["o_proj", "lm_head"], feedforward_modules=[]), ("o_proj",)),
    ],
    ids=["loha-lm_head", "ia3-o_proj-kept"],
)
def test_methods_on_high_precision_layers_of_an_fp8_model_train_as_without_fp8(config, skip):
    """lm_head (kept by default) and a layer kept by skip= take any peft method: the trained
    adapters and the merged model match the same run on the dequantized model."""
    fp8 = _llama(skip=skip)
    assert isinstance(fp8.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert not isinstance(fp8.lm_head, Fp8Linear)
    dense = copy.deepcopy(fp8).dequantize()
    trained, merged = [], []
    for model in (fp8, dense):
        torch.manual_seed(1)
        peft_model = get_peft_model(model, copy.deepcopy(config))
        before = {
            n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad
        }
        trained.append(_train(peft_model))
        assert any(not torch.equal(trained[-1][n], v) for n, v in before.items())
        merged.append(_logits(peft_model.merge_and_unload()))
    assert trained[0].keys() == trained[1].keys()
    for name, value in trained[0].items():
        torch.testing.assert_close(value, trained[1][name], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged[0], merged[1], rtol=1e-4, atol=1e-5)


def test_a_method_in_a_mixed_peft_model_on_fp8_layers_is_refused():
    """peft's mixed models inject through the same tuners. (transformers 5.24's
    ``model.add_adapter`` needs peft >= 0.22; it goes through ``inject_adapter`` too.)"""
    with pytest.raises(ValueError, match=r"peft LOKR \(LoKrConfig\).*q_proj, an FP8 layer"):
        get_peft_model(_llama(), _config("LOKR", ["q_proj"]), mixed=True)


@pytest.mark.slow
def test_missing_peft_tuner_api_turns_only_the_method_check_off():
    """The check fails alone: LoRA (and its merge registration) and the modules_to_save check
    keep working, one warning."""
    from tests.patches.helpers import check, patch_warnings, run_python

    result = run_python(
        """
        import hf_fp8.patches.peft_lora as patch  # before peft: the patch waits for it
        patch.TUNERS = "peft.tuners.moved"  # as if peft moved BaseTuner
        import hf_fp8, torch
        from peft import LoraConfig, get_peft_model
        from tests.tiny_models import TINY
        config_cls, model_cls, kwargs = TINY["llama"]
        model = hf_fp8.quantize_model(model_cls(config_cls(**kwargs)), hf_fp8.Fp8Config())
        config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj"])
        try:
            get_peft_model(model, config)
        except ValueError as exc:
            print("refused" if "modules_to_save" in str(exc) else exc)
        config = LoraConfig(r=4, target_modules=["q_proj"])
        layer = get_peft_model(model, config).base_model.model.model.layers[0].self_attn.q_proj
        print(type(layer).__name__, hf_fp8.patches.status()["peft_lora"])
        """
    )
    out = check(result)
    (warning,) = patch_warnings(result.stderr)
    assert "partly disabled" in warning and "methods other than LoRA" in warning
    assert out.startswith("refused\nFp8LoraLinear partly off: ")
