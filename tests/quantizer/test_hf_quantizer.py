"""Fp8HfQuantizer behaviour: registration, skips, reload, errors, device maps, flags."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.bitwise import assert_states_bit_equal
from tests.tiny_models import model_inputs


def _load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def test_import_registers_hf_fp8_once():
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
    )

    hf_fp8.register_with_transformers()  # a second registration is harmless
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["hf_fp8"] is Fp8Config
    assert AUTO_QUANTIZER_MAPPING["hf_fp8"] is hf_fp8.Fp8HfQuantizer
    assert (
        AUTO_QUANTIZATION_CONFIG_MAPPING["fp8"] is not Fp8Config
    )  # the built-in name is left alone


def test_default_and_user_skips(tiny_model_dir):
    config = Fp8Config("dynamic", modules_to_not_convert=["mlp.down_proj"])
    model = _load(tiny_model_dir("llama"), quantization_config=config)
    assert type(model.lm_head) is torch.nn.Linear  # output embeddings: default skip
    for layer in model.model.layers:
        assert type(layer.mlp.down_proj) is torch.nn.Linear
        assert isinstance(layer.mlp.up_proj, Fp8Linear)
    assert {"lm_head", "mlp.down_proj"} <= set(
        model.config.quantization_config.modules_to_not_convert
    )


def test_a_cpu_load_builds_the_cpu_kernel_while_loading(tiny_model_dir, monkeypatch):
    """The C kernel is built in the background during the load, not at the first forward."""
    from hf_fp8.kernels import cpu_kernel

    calls = []
    monkeypatch.setattr(cpu_kernel, "prebuild", lambda: calls.append(1))
    _load(tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic"))
    assert calls == [1]


def test_saved_checkpoint_layout_and_size(tiny_model_dir, tmp_path):
    bf16_dir = tiny_model_dir("llama", torch.bfloat16)
    model = _load(bf16_dir, quantization_config=Fp8Config("static", activation_scale=0.1))
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    prefix = "model.layers.0.self_attn.q_proj."
    assert dtypes[prefix + "weight"] == "F8_E4M3"
    assert dtypes[prefix + "weight_scale"] == "F32"
    assert dtypes[prefix + "input_scale"] == "F32"
    assert "F8_E4M3" not in {d for k, d in dtypes.items() if "norm" in k or "embed" in k}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "hf_fp8"
    assert config["dtype"] == "bfloat16"
    # linear weights: 1 byte + one fp32 scale per row
    fp8 = load_file(tmp_path / "model.safetensors")
    linear = [k[: -len(".weight")] for k, v in fp8.items() if v.dtype == torch.float8_e4m3fn]
    nbytes = sum(fp8[k + ".weight"].nbytes + fp8[k + ".weight_scale"].nbytes for k in linear)
    params = sum(fp8[k + ".weight"].numel() for k in linear)
    assert nbytes / params <= 1.07  # 1 + 4/in_features with in_features = 64 or 128


def test_reload_keeps_fp8_frozen_and_config(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic"))
    model.save_pretrained(tmp_path)
    reloaded = _load(tmp_path)
    assert reloaded.config.quantization_config == model.config.quantization_config
    for m in reloaded.modules():
        if isinstance(m, Fp8Linear):
            assert not m.weight.requires_grad and not m.weight_scale.requires_grad
    assert reloaded.dtype == torch.float32


def test_sharded_save_reloads(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic"))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    assert_states_bit_equal(model, _load(tmp_path))


def test_missing_weight_scale_names_the_key(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic"))
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale"):
        _load(tmp_path)


def test_uncalibrated_static_checkpoint_reloads_and_asks_for_calibration(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("static"))
    with pytest.raises(RuntimeError, match="calibrate"):
        model(**model_inputs("llama"))
    model.save_pretrained(tmp_path)
    reloaded = _load(tmp_path)
    assert reloaded.model.layers[0].mlp.up_proj.input_scale is None
    with pytest.raises(RuntimeError, match=r"hf_fp8\.calibrate"):
        reloaded(**model_inputs("llama"))


def test_per_module_static_scales(tiny_model_dir):
    name = "model.layers.0.mlp.up_proj"
    config = Fp8Config("static", activation_scale=0.5, activation_scales={name: 0.25})
    model = _load(tiny_model_dir("llama"), quantization_config=config)
    assert float(model.get_submodule(name).input_scale) == 0.25
    assert float(model.model.layers[1].mlp.up_proj.input_scale) == 0.5


def test_dequantize_returns_plain_model(tiny_model_dir):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("weight_only"))
    inputs = model_inputs("llama")
    out = model(**inputs).logits
    plain = model.dequantize()
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())
    assert getattr(plain.config, "quantization_config", None) is None
    # weight-only: the dequantized weights reproduce the FP8 model up to fp32 summation order
    torch.testing.assert_close(plain(**inputs).logits, out, rtol=1e-4, atol=1e-4)


def test_dequantize_flag_loads_fp8_checkpoint_in_high_precision(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("weight_only"))
    model.save_pretrained(tmp_path)
    plain = _load(tmp_path, quantization_config=Fp8Config("weight_only", dequantize=True))
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())
    expected = model.model.layers[0].mlp.up_proj.dequantize_weight()
    assert torch.equal(plain.model.layers[0].mlp.up_proj.weight, expected)


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}])
def test_device_map_for_prequantized(device_map, tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic"))
    model.save_pretrained(tmp_path)
    reloaded = _load(tmp_path, device_map=device_map)
    assert_states_bit_equal(model, reloaded)


def test_explicit_device_map_per_module(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic"))
    model.save_pretrained(tmp_path)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    reloaded = _load(tmp_path, device_map=device_map)
    inputs = model_inputs("llama")
    assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)


def test_quantizer_flags(tiny_model_dir):
    model = _load(tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic"))
    quantizer = model.hf_quantizer
    assert quantizer.is_serializable() and quantizer.is_trainable and quantizer.is_compileable
    assert not quantizer.is_qat_trainable


def test_fp8_dtype_as_load_dtype_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="compute dtype"):
        _load(tiny_model_dir("llama"), dtype=torch.float8_e4m3fn, quantization_config=Fp8Config())


def test_quantize_model_matches_from_pretrained(tiny_model_dir):
    path = tiny_model_dir("llama")
    loaded = _load(path, quantization_config=Fp8Config("dynamic"))
    converted = hf_fp8.quantize_model(_load(path), Fp8Config("dynamic"), skip=["lm_head"])
    for name, m in loaded.named_modules():
        if isinstance(m, Fp8Linear):
            other = converted.get_submodule(name)
            assert torch.equal(m.weight.view(torch.uint8), other.weight.view(torch.uint8))
            assert torch.equal(m.weight_scale, other.weight_scale)


def test_quantize_model_checkpoint_reloads_with_fp8_output_layer(tiny_model_dir, tmp_path):
    plain = _load(tiny_model_dir("llama"))
    model = hf_fp8.quantize_model(
        plain, Fp8Config("weight_only"), skip=["down_proj"], default_skips=False
    )
    assert isinstance(model.lm_head, Fp8Linear)  # default skips off: the untied head converts
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["modules_to_not_convert"] == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    reloaded = _load(tmp_path)
    assert isinstance(reloaded.lm_head, Fp8Linear)
    assert type(reloaded.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert_states_bit_equal(model, reloaded)


def test_empty_skip_list_round_trips():
    config = Fp8Config("dynamic", modules_to_not_convert=[])
    assert config.modules_to_not_convert == []
    assert Fp8Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_layers_are_swapped_on_meta_without_a_device_context():
    """The swap builds meta layers itself (the loader's meta context is not needed) and
    leaves the tensor-parallel plans alone."""
    from tests.tiny_models import TINY

    config_cls, model_cls, kwargs = TINY["llama"]
    with torch.device("meta"):
        model = model_cls(config_cls(**kwargs))
    quantizer = hf_fp8.Fp8HfQuantizer(Fp8Config("dynamic"), pre_quantized=False)
    tp_plan, ep_plan = dict(model.tp_plan), dict(model.ep_plan)
    quantizer.preprocess_model(model)
    swapped = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(swapped) == 7 * kwargs["num_hidden_layers"]
    assert all(p.is_meta for m in swapped.values() for p in m.parameters())
    assert all(m._is_hf_initialized for m in swapped.values())
    assert type(model.lm_head) is torch.nn.Linear
    assert model.tp_plan == tp_plan and model.ep_plan == ep_plan
