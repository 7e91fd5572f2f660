"""The "keep this layer in high precision" advice of the peft refusals works where it is given
(R13 2).

The refusals of ``modules_to_save``, methods other than LoRA and LoRA on FP8 experts advised
``Fp8Config(..., modules_to_not_convert=[...])``, which does nothing on a model loaded from an
FP8 (pre-quantized) checkpoint: transformers uses the checkpoint's own quantization_config, the
layer stays FP8 and the same refusal returns. Each test here follows the advice printed in the
message, as a user would (copying the calls it names, or adding the names it lists to their own
config), and checks that the retry is accepted and that the kept layer trains, for a model
loaded from an FP8 checkpoint and for one quantized on the fly.
"""

from __future__ import annotations

import ast
import copy
import re

import pytest
import torch
import transformers as tf
from peft import IA3Config, LoraConfig, get_peft_model
from torch import nn

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules import Fp8Experts
from tests.serialization.moe_fixtures import tiny_qwen3_moe
from tests.tiny_models import LLAMA_ONE_LAYER, model_inputs

SCHEME = "dynamic"  # the scheme of llama_fp8_dir and of the on-the-fly loads here

REFUSED = {
    "modules_to_save": (
        lambda: LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["o_proj"]),
        "o_proj",
        lambda layer: layer.modules_to_save["default"].weight,
    ),
    "ia3": (
        lambda: IA3Config(target_modules=["v_proj"], feedforward_modules=[]),
        "v_proj",
        lambda layer: layer.ia3_l["default"],
    ),
}


def _call(message: str, start: str) -> str:
    """The call in ``message`` that begins with ``start`` (parentheses balanced)."""
    i = message.index(start)
    depth = 0
    for j in range(message.index("(", i), len(message)):
        depth += {"(": 1, ")": -1}.get(message[j], 0)
        if depth == 0:
            return message[i : j + 1]
    raise AssertionError(f"unbalanced call after {start!r} in {message!r}")


def _listed(message: str, word: str) -> list[str]:
    """The list after the last ``word=`` of the advice."""
    found = re.findall(rf"{word}=(\[[^\]]*\])", message[message.rindex("in high precision: ") :])
    assert found, message
    return ast.literal_eval(found[-1])


def _follow_the_advice(message: str, checkpoint: str, high_dir: str) -> nn.Module:
    """What a user does with the refusal: run the calls it names for an FP8 checkpoint, or
    add the names it lists to the ``Fp8Config`` of their on-the-fly load (the advice is the
    clause after the last "in high precision: ")."""
    message = message[message.rindex("in high precision: ") :]
    names = {"hf_fp8": hf_fp8, "path": checkpoint}
    if "from_pretrained(path, " in message:
        load = _call(message, "from_pretrained(path, ")
        model = eval(f"tf.AutoModelForCausalLM.{load}", {**names, "tf": tf})
        return eval(_call(message, "hf_fp8.quantize_model(model, "), {**names, "model": model})
    listed = re.search(r"modules_to_not_convert=(\[[^\]]*\])", message)
    assert listed, message
    config = Fp8Config(SCHEME, modules_to_not_convert=ast.literal_eval(listed.group(1)))
    return tf.AutoModelForCausalLM.from_pretrained(high_dir, quantization_config=config)


def _trains(model: nn.Module, param: torch.Tensor) -> bool:
    """One AdamW step on the trainable parameters: ``param`` gets a gradient and moves."""
    before = param.detach().clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = model_inputs("llama")
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    moved = not torch.equal(before, param.detach())
    return param.grad is not None and bool(param.grad.abs().sum() > 0) and moved


@pytest.mark.parametrize("kind", sorted(REFUSED))
@pytest.mark.parametrize("origin", ["fp8 checkpoint", "on the fly"])
def test_following_the_advice_keeps_the_layer_trainable(
    kind, origin, llama_fp8_dir, tiny_model_dir
):
    make_config, layer_name, trained = REFUSED[kind]
    high_dir = tiny_model_dir("llama")
    if origin == "fp8 checkpoint":
        model = tf.AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(
            high_dir, quantization_config=Fp8Config(SCHEME)
        )
    with pytest.raises(ValueError, match=rf"{layer_name}, an FP8 layer") as err:
        get_peft_model(model, make_config())
    message = str(err.value)
    if origin == "fp8 checkpoint":  # the advice that did nothing there is gone
        assert "modules_to_not_convert=[" not in message
        assert "dequantize=True" in message and layer_name in _listed(message, "skip")
    else:  # the advice that works when quantizing on the fly is kept
        assert layer_name in _listed(message, "modules_to_not_convert")
    kept = _follow_the_advice(message, str(llama_fp8_dir), high_dir)
    attention = kept.model.layers[0].self_attn
    assert type(getattr(attention, layer_name)) is nn.Linear
    assert isinstance(attention.k_proj, Fp8Linear) and isinstance(attention.q_proj, Fp8Linear)
    peft_model = get_peft_model(kept, make_config())  # accepted now
    layer = getattr(peft_model.base_model.model.model.layers[0].self_attn, layer_name)
    assert _trains(peft_model, trained(layer))


def test_requantized_checkpoint_layers_equal_the_checkpoint(llama_fp8_dir):
    """The route for an FP8 checkpoint (high-precision load, quantize again) gives back the
    checkpoint's fp8 codes and scales for every layer it converts again."""
    loaded = tf.AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    with pytest.raises(ValueError) as err:
        get_peft_model(copy.deepcopy(loaded), REFUSED["ia3"][0]())
    again = _follow_the_advice(str(err.value), str(llama_fp8_dir), "")
    fp8 = {n: m for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)}
    redone = {n: m for n, m in again.named_modules() if isinstance(m, Fp8Linear)}
    assert set(redone) == set(fp8) - {n for n in fp8 if n.endswith("v_proj")}
    for name, module in redone.items():
        assert torch.equal(module.weight.view(torch.uint8), fp8[name].weight.view(torch.uint8))
        assert torch.equal(module.weight_scale, fp8[name].weight_scale)


def test_lora_on_fp8_experts_of_a_checkpoint_advises_the_route_that_works(tmp_path):
    high = tiny_qwen3_moe()
    high.save_pretrained(tmp_path / "high")
    fp8 = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "high", quantization_config=Fp8Config(SCHEME)
    )
    fp8.save_pretrained(tmp_path / "fp8")
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    config = LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(NotImplementedError, match=r"FP8 experts") as err:
        get_peft_model(model, copy.deepcopy(config))
    message = str(err.value)
    assert "modules_to_not_convert=[" not in message and "experts" in _listed(message, "skip")
    kept = _follow_the_advice(message, str(tmp_path / "fp8"), "")
    experts = kept.model.layers[0].mlp.experts
    assert not isinstance(experts, Fp8Experts)
    assert isinstance(kept.model.layers[0].self_attn.q_proj, Fp8Linear)
    peft_model = get_peft_model(kept, config)
    lora_a = [p for n, p in peft_model.named_parameters() if "lora_A" in n]
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_a and lora_b
    assert _trains(peft_model, lora_b[0])  # (lora_B starts at zero: lora_A has no grad yet)


def test_a_trainable_copy_of_a_checkpoint_layer_names_the_route_that_works(llama_fp8_dir):
    """The forward error of a trainable FP8 copy (``check_frozen``)."""
    model = tf.AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    layer = copy.deepcopy(model.model.layers[0].self_attn.o_proj).requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"o_proj\.weight has requires_grad=True") as err:
        layer(torch.randn(2, layer.in_features))
    message = str(err.value)
    assert "modules_to_not_convert=[" not in message
    kept = _follow_the_advice(message, str(llama_fp8_dir), "")
    assert type(kept.model.layers[0].self_attn.o_proj) is nn.Linear
    assert isinstance(kept.model.layers[0].self_attn.q_proj, Fp8Linear)


# R16 2: the advice listed only the refused layer, so following it converted the layers the
# checkpoint (or the user's own skips) kept in high precision, silently (down_proj: 2.5 %
# weight error). Following it now changes the refused layer and nothing else.
CHECKPOINTS = {
    "custom skips": dict(modules_to_not_convert=["down_proj"]),
    "e5m2": dict(fp8_format="e5m2", modules_to_not_convert=["down_proj", "k_proj"]),
    "block weights": dict(
        weight_granularity="block", block_size=[32, 32], modules_to_not_convert=["up_proj"]
    ),
    "tensor weights": dict(weight_granularity="tensor", modules_to_not_convert=["down_proj"]),
    "mse weight scales": dict(weight_scale_method="mse", modules_to_not_convert=["gate_proj"]),
    "fp8 lm_head": None,  # quantize_model(..., default_skips=False): lm_head stored FP8
}


def _modules_to_save_refusal(model: nn.Module) -> str:
    with pytest.raises(ValueError, match=r"o_proj, an FP8 layer") as err:
        get_peft_model(copy.deepcopy(model), REFUSED["modules_to_save"][0]())
    return str(err.value)


def _same_tensors_but_o_proj(before: nn.Module, after: nn.Module, high: nn.Module | None) -> None:
    """Every tensor of ``after`` equals ``before``'s (dtype and bits), but ``o_proj``, which
    is high precision in ``after`` and equals ``high``'s weight (the high-precision model
    quantized on the fly), or ``before``'s dequantized weight (an FP8 checkpoint: ``None``)."""
    old, new = before.state_dict(), after.state_dict()
    o_proj = [k for k in old if ".o_proj." in k]
    assert set(new) == set(old) - {k for k in o_proj if not k.endswith((".weight", ".bias"))}
    for key, tensor in new.items():
        if ".o_proj." in key:
            continue
        assert new[key].dtype == old[key].dtype, key
        assert torch.equal(tensor.view(torch.uint8), old[key].view(torch.uint8)), key
    for name, module in before.named_modules():
        if name.endswith("o_proj"):
            kept = after.get_submodule(name)
            assert type(kept) is nn.Linear and isinstance(module, Fp8Linear)
            if high is None:
                reference = module.dequantize_weight(kept.weight.dtype)
            else:
                reference = high.get_submodule(name).weight
            assert torch.equal(kept.weight, reference)


@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_following_the_checkpoint_advice_changes_only_the_refused_layer(
    kind, tiny_model_dir, tmp_path
):
    """An FP8 checkpoint with its own skips (and e5m2, block or tensor weight scales, MSE
    weight scales): the high-precision load and the quantization again give back the
    checkpoint's codes and scales for every other layer, and its high-precision layers (an
    FP8 ``lm_head`` too)."""
    if CHECKPOINTS[kind] is None:
        made = tf.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
        hf_fp8.quantize_model(made, Fp8Config(SCHEME), skip=["v_proj"], default_skips=False)
    else:
        config = Fp8Config(SCHEME, **CHECKPOINTS[kind])
        made = tf.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir("llama"), quantization_config=config
        )
    made.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    message = _modules_to_save_refusal(loaded)
    saved = loaded.config.quantization_config.modules_to_not_convert
    assert _listed(message, "skip") == [*saved, "o_proj"]
    again = _follow_the_advice(message, str(tmp_path), "")
    _same_tensors_but_o_proj(loaded, again, None)
    get_peft_model(again, REFUSED["modules_to_save"][0]())  # accepted now


@pytest.mark.parametrize("origin", ["on the fly", "quantize_model", "fp8 lm_head"])
def test_following_the_advice_keeps_the_users_own_skips(origin, tiny_model_dir):
    """Quantized from high precision with the user's skips: the listed names are those skips
    plus the refused layer (not the default skips, which come back by themselves), and
    loading / quantizing with them as advised changes only that layer; an ``lm_head`` the
    user converted (``default_skips=False``) stays FP8."""
    high_dir = tiny_model_dir("llama")
    if origin == "on the fly":
        config = Fp8Config(SCHEME, modules_to_not_convert=["down_proj", "lm_head"])
        model = tf.AutoModelForCausalLM.from_pretrained(high_dir, quantization_config=config)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(high_dir)
        defaults = origin != "fp8 lm_head"
        hf_fp8.quantize_model(model, Fp8Config(SCHEME), skip=["down_proj"], default_skips=defaults)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    message = _modules_to_save_refusal(model)
    listed = _listed(message, "skip")
    assert listed == ["down_proj", "o_proj"]
    if origin == "fp8 lm_head":  # R18 F3: Fp8Config always keeps lm_head, so no load route
        assert "modules_to_not_convert=" not in message[message.rindex("in high precision: ") :]
    else:
        assert _listed(message, "modules_to_not_convert") == listed
    if origin == "on the fly":
        config = Fp8Config(SCHEME, modules_to_not_convert=listed)
        again = tf.AutoModelForCausalLM.from_pretrained(high_dir, quantization_config=config)
    else:
        again = tf.AutoModelForCausalLM.from_pretrained(high_dir)
        call = _call(message[message.rindex("in high precision: ") :], "hf_fp8.quantize_model(")
        eval(call, {"hf_fp8": hf_fp8, "model": again, "config": Fp8Config(SCHEME)})
    assert isinstance(again.lm_head, Fp8Linear) == (origin == "fp8 lm_head")
    _same_tensors_but_o_proj(model, again, tf.AutoModelForCausalLM.from_pretrained(high_dir))


# R18: following the quantize_model advice converted layers the model kept: those a
# module_filter_fn kept (F1), or those a second quantize_model call converted after the first
# one's skips (F2). The advice now lists what the model keeps now.
def _quantize_as_advised(message: str, high_dir: str) -> nn.Module:
    again = tf.AutoModelForCausalLM.from_pretrained(high_dir)
    call = _call(message[message.rindex("in high precision: ") :], "hf_fp8.quantize_model(")
    return eval(call, {"hf_fp8": hf_fp8, "model": again, "config": Fp8Config(SCHEME)})


@pytest.mark.parametrize("case", ["module_filter_fn", "filter and skip", "second call"])
def test_following_the_advice_keeps_what_the_model_keeps_now(case, tiny_model_dir):
    high_dir = tiny_model_dir("llama")
    model = tf.AutoModelForCausalLM.from_pretrained(high_dir)
    if case == "second call":  # the MLP skipped first, then converted too
        hf_fp8.quantize_model(model, Fp8Config(SCHEME), skip=["mlp"])
        hf_fp8.quantize_model(model, Fp8Config(SCHEME), skip=["k_proj"])
        assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)
    else:
        skip = ["k_proj"] if case == "filter and skip" else None
        hf_fp8.quantize_model(
            model, Fp8Config(SCHEME), skip=skip, module_filter_fn=lambda m, n: ".mlp." not in n
        )
        assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    message = _modules_to_save_refusal(model)
    again = _quantize_as_advised(message, high_dir)
    assert not isinstance(again.lm_head, Fp8Linear)
    _same_tensors_but_o_proj(model, again, tf.AutoModelForCausalLM.from_pretrained(high_dir))


def test_defaults_off_advice_only_offers_quantize_model(tiny_model_dir):
    """R18 F3: ``default_skips=False`` left lm_head FP8; the advice's ``Fp8Config`` load
    would keep it in high precision, so only the quantize_model route is offered, and
    following it changes only the refused layer."""
    high_dir = tiny_model_dir("llama")
    model = tf.AutoModelForCausalLM.from_pretrained(high_dir)
    hf_fp8.quantize_model(model, Fp8Config(SCHEME), skip=["k_proj"], default_skips=False)
    assert isinstance(model.lm_head, Fp8Linear)
    message = _modules_to_save_refusal(model)
    assert "modules_to_not_convert=" not in message[message.rindex("in high precision: ") :]
    again = _quantize_as_advised(message, high_dir)
    _same_tensors_but_o_proj(model, again, tf.AutoModelForCausalLM.from_pretrained(high_dir))


def test_quantizing_a_peft_model_lists_the_kept_layers_by_their_plain_names():
    """On a ``PeftModel`` the layers a filter kept sit under peft's wrappers
    (``q_proj.base_layer``); the advice names them as a fresh model does (``q_proj``)."""
    from hf_fp8.modules.origin import skips_of

    torch.manual_seed(0)
    high = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_ONE_LAYER))
    peft_model = get_peft_model(copy.deepcopy(high), LoraConfig(r=4, target_modules=["q_proj"]))
    hf_fp8.quantize_model(
        peft_model, Fp8Config(SCHEME), module_filter_fn=lambda m, n: "q_proj" not in n
    )
    listed = skips_of(peft_model.get_base_model().model.layers[0].self_attn.k_proj)
    assert listed == ["model.layers.0.self_attn.q_proj"]
    again = hf_fp8.quantize_model(high, Fp8Config(SCHEME), skip=listed)
    fp8 = {n for n, m in again.named_modules() if isinstance(m, Fp8Linear)}
    was = {n for n, m in peft_model.get_base_model().named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == was
