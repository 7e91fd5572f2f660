"""``hf_fp8.quantize_model`` on a model that already holds peft adapters (R13 1).

It used to convert each adapted layer's ``base_layer`` into an ``Fp8Linear`` inside peft's
stock layer (not hf_fp8's ``Fp8LoraLinear``), past every FP8 check ``get_peft_model`` runs:
DoRA's forward was off by 1.18 (relative), HRA's by 1.23 (it read fp8 codes as numbers),
HRA / BOFT ``merge_and_unload`` rewrote the fp8 codes in place, LoRA / IA3 merges failed with a
bare "Promotion for Float8 Types". Now it refuses before converting anything and names the two
routes that work; these tests follow both and compare each with a reference: the same adapters
on the dequantized weights.
"""

from __future__ import annotations

import ast
import copy

import pytest
import torch
import transformers as tf
from peft import (
    BOFTConfig,
    HRAConfig,
    IA3Config,
    LoraConfig,
    get_peft_model,
    inject_adapter_in_model,
)
from torch import nn

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules import Fp8Experts
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import _DECODER, model_inputs

CONFIGS = {
    "lora": lambda: LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    "dora": lambda: LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], use_dora=True, init_lora_weights=False
    ),
    "hra": lambda: HRAConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False),
    "boft": lambda: BOFTConfig(
        boft_block_size=4, target_modules=["q_proj", "v_proj"], init_weights=False
    ),
    "ia3": lambda: IA3Config(
        target_modules=["q_proj", "v_proj"], feedforward_modules=[], init_ia3_weights=False
    ),
}


def _llama() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_DECODER)).eval()


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs("llama")).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _with_dequantized_weights(reference: nn.Module, quantized: nn.Module) -> nn.Module:
    """``reference`` (same structure, high precision) with the weight of every layer that is an
    ``Fp8Linear`` in ``quantized`` replaced by its dequantized value."""

    def plain(name: str) -> str:  # a peft layer's base_layer stands for the layer itself
        return name.replace(".base_layer", "")

    fp8 = {plain(n): m for n, m in quantized.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8
    with torch.no_grad():
        for name, module in reference.named_modules():
            if plain(name) in fp8 and isinstance(module, nn.Linear):
                module.weight.copy_(fp8[plain(name)].dequantize_weight(torch.float32))
    return reference


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_quantize_model_refuses_a_peft_model_and_changes_nothing(method):
    model = get_peft_model(_llama(), CONFIGS[method]())
    before = _state(model)
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"peft") as err:
        hf_fp8.quantize_model(model, Fp8Config("weight_only"))
    message = str(err.value)
    assert "model.layers.0.self_attn.q_proj" in message and "v_proj" in message
    assert "get_peft_model" in message and "merge_and_unload()" in message
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert [type(m) for m in model.modules()] == types
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_adapters_injected_into_a_transformers_model_are_refused_too():
    """``inject_adapter_in_model`` leaves a plain ``PreTrainedModel`` holding peft layers. It
    has no ``merge_and_unload`` (R16 6: the refusal advised it, an ``AttributeError``): the
    advice names only routes that work there, and its skip route is accepted."""
    model = inject_adapter_in_model(CONFIGS["dora"](), _llama())
    with pytest.raises(ValueError, match=r"peft .*q_proj") as err:
        hf_fp8.quantize_model(model, Fp8Config("dynamic"))
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    message = str(err.value)
    assert not hasattr(model, "merge_and_unload")
    assert "merge_and_unload" not in message and "get_peft_model" in message
    skip = ast.literal_eval(message[message.rindex("skip=") + len("skip=") :])
    hf_fp8.quantize_model(model, Fp8Config("dynamic"), skip=skip)
    assert isinstance(model.model.layers[0].self_attn.k_proj, Fp8Linear)
    assert type(model.model.layers[0].self_attn.q_proj.base_layer) is nn.Linear


def test_a_peft_mixed_model_is_handled_like_a_peft_model(tmp_path):
    """``get_peft_model(..., mixed=True)`` (R16 3): its transformers model keeps its default
    skips (``lm_head``) and is marked quantized, so merged it saves and reloads; every tensor
    equals the same steps on a ``PeftModel``."""
    config = LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    done = {}
    for mixed in (False, True):
        torch.manual_seed(1)
        model = get_peft_model(_llama(), copy.deepcopy(config), mixed=mixed)
        hf_fp8.quantize_model(model, Fp8Config("dynamic"), skip=["q_proj"])
        inner = model.base_model.model
        assert type(inner.lm_head) is nn.Linear
        assert isinstance(inner.model.layers[0].self_attn.k_proj, Fp8Linear)
        assert inner.is_quantized and inner.config.quantization_config.quant_method == "hf_fp8"
        merged = model.merge_and_unload()
        merged.save_pretrained(tmp_path / str(mixed))
        reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / str(mixed))
        assert torch.equal(_logits(reloaded), _logits(merged))
        done[mixed] = _state(reloaded)
    assert done[True].keys() == done[False].keys()
    for key, tensor in done[False].items():
        assert done[True][key].dtype == tensor.dtype, key
        assert torch.equal(done[True][key].view(torch.uint8), tensor.view(torch.uint8)), key


def test_lora_on_experts_parameters_is_refused_too():
    """LoRA ``target_parameters`` wraps the experts module (peft's ``ParamWrapper``)."""
    model = tiny_qwen3_moe()
    config = LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    model = get_peft_model(model, config)
    with pytest.raises(ValueError, match=r"peft .*mlp\.experts"):
        hf_fp8.quantize_model(model, Fp8Config("dynamic"))
    assert not any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules())


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_advised_route_quantize_first_matches_the_dequantized_reference(method):
    """Quantize first, then ``get_peft_model``: peft builds ``Fp8LoraLinear``; its forward and
    its merge equal the same adapters on the dequantized weights."""
    base = hf_fp8.quantize_model(_llama(), Fp8Config("weight_only"))
    dense = _with_dequantized_weights(_llama(), base)
    torch.manual_seed(1)
    fp8 = get_peft_model(base, CONFIGS[method]())
    torch.manual_seed(1)
    reference = get_peft_model(dense, CONFIGS[method]())
    assert _rel(_logits(fp8), _logits(reference)) < 1e-5
    merged, merged_ref = fp8.merge_and_unload(), reference.merge_and_unload()
    assert _rel(_logits(merged), _logits(merged_ref)) < 1e-5


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_advised_route_merge_first_matches_the_dequantized_reference(method):
    """``merge_and_unload()`` first, then quantize: the FP8 model equals the merged
    high-precision model with its weights dequantized, and stays close to the merged model."""
    peft_model = get_peft_model(_llama(), CONFIGS[method]())
    with pytest.raises(ValueError):
        hf_fp8.quantize_model(peft_model, Fp8Config("weight_only"))
    merged = peft_model.merge_and_unload()
    high = copy.deepcopy(merged)
    fp8 = hf_fp8.quantize_model(merged, Fp8Config("weight_only"))
    assert isinstance(fp8.model.layers[0].self_attn.q_proj, Fp8Linear)
    reference = _with_dequantized_weights(copy.deepcopy(high), fp8)
    assert _rel(_logits(fp8), _logits(reference)) < 1e-5
    assert _rel(_logits(fp8), _logits(high)) < 0.05


def test_modules_to_save_copy_and_skipped_adapted_layers_still_quantize(tmp_path):
    """A ``ModulesToSaveWrapper`` is no adapter layer: its original converts, its trainable
    copy stays high precision and trains; an adapted layer kept with ``skip`` is allowed. The
    transformers model inside the ``PeftModel`` keeps its default skips (``lm_head``) and is
    marked quantized: merged, it saves and reloads."""
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj"])
    model = get_peft_model(_llama(), config)
    high = copy.deepcopy(model)
    hf_fp8.quantize_model(model, Fp8Config("weight_only"), skip=["q_proj"])
    wrapper = model.base_model.model.model.layers[0].self_attn.o_proj
    assert isinstance(wrapper.original_module, Fp8Linear)
    copy_ = wrapper.modules_to_save["default"]
    assert type(copy_) is nn.Linear and copy_.weight.requires_grad
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer) is nn.Linear
    assert isinstance(model.base_model.model.model.layers[0].self_attn.k_proj, Fp8Linear)
    reference = _with_dequantized_weights(high, model)
    assert _rel(_logits(model), _logits(reference)) < 1e-5
    batch = model_inputs("llama")
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    assert copy_.weight.grad is not None and copy_.weight.grad.abs().sum() > 0
    assert type(model.base_model.model.lm_head) is nn.Linear
    merged = model.eval().merge_and_unload()
    assert type(merged.model.layers[0].self_attn.o_proj) is nn.Linear  # the trained copy
    merged.save_pretrained(tmp_path)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(reloaded.model.layers[0].self_attn.k_proj, Fp8Linear)
    assert torch.equal(_logits(reloaded), _logits(merged))


def test_an_adapter_folder_loaded_with_fp8config_gets_fp8_lora_layers(tmp_path):
    """``from_pretrained(<adapter folder>, quantization_config=Fp8Config(...))``: transformers
    quantizes the base, then injects the adapter: hf_fp8's ``Fp8LoraLinear`` over ``Fp8Linear``
    (the base is never converted under an adapter). Plain LoRA: transformers 5.24 loads DoRA's
    magnitude only with peft >= 0.22, FP8 or not."""
    from peft import PeftModel

    from hf_fp8.lora import Fp8LoraLinear

    base = _llama()
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, CONFIGS["lora"]())
    peft_model.save_pretrained(tmp_path / "adapter")
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = str(tmp_path / "base")
    config.save_pretrained(tmp_path / "adapter")
    loaded = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "adapter", quantization_config=Fp8Config("weight_only")
    )
    q_proj = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Fp8LoraLinear) and isinstance(q_proj.base_layer, Fp8Linear)
    dense = _with_dequantized_weights(_llama(), loaded)
    reference = PeftModel.from_pretrained(dense, tmp_path / "adapter")
    assert _rel(_logits(loaded), _logits(reference)) < 1e-5
