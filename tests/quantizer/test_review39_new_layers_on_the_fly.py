"""R39 F1 / F4: an on-the-fly load (a float checkpoint + ``Fp8Config``) of a model with layers
the checkpoint does not store as the model has them: a layer it lacks (a masked-LM BERT
loaded as ``AutoModel``: the pooler; a config with more layers than stored) or one resized
under ``ignore_mismatched_sizes=True``. transformers initialises those layers in the float
model; the FP8 model must load the same way, then quantize them: the reference is the float
model loaded the same way, with the same seed, then ``hf_fp8.quantize_model``."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules import Fp8Linear

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 3, 7]])


def _llama(folder):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _reference(cls, folder, scheme, seed, **kwargs):
    """The float model loaded the same way, with the same seed, then quantized."""
    torch.manual_seed(seed)
    model = cls.from_pretrained(folder, **kwargs)
    return hf_fp8.quantize_model(model, Fp8Config(scheme))


def _fp8(cls, folder, scheme, seed, **kwargs):
    torch.manual_seed(seed)
    return cls.from_pretrained(folder, quantization_config=Fp8Config(scheme), **kwargs)


def _same_layers(model, ref):
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    fp8_ref = {n: m for n, m in ref.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(fp8) == sorted(fp8_ref)
    for name, module in fp8.items():
        other = fp8_ref[name]
        assert torch.equal(module.weight.view(torch.uint8), other.weight.view(torch.uint8)), name
        assert torch.equal(module.weight_scale, other.weight_scale), name
        assert (module.bias is None) == (other.bias is None), name
        if module.bias is not None:
            assert torch.equal(module.bias, other.bias), name
        assert not module.weight.requires_grad and not module.weight_scale.requires_grad


@pytest.mark.parametrize("scheme", ["dynamic", "weight_only"])
def test_masked_lm_checkpoint_as_base_model_quantizes_the_new_pooler(scheme, tmp_path):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertForMaskedLM(config).save_pretrained(tmp_path)
    ref = _reference(AutoModel, tmp_path, scheme, seed=3)
    model = _fp8(AutoModel, tmp_path, scheme, seed=3)
    assert isinstance(ref.pooler.dense, Fp8Linear)  # the reference quantizes the pooler
    _same_layers(model, ref)
    with torch.no_grad():
        out, out_ref = model(IDS), ref(IDS)
    assert torch.equal(out.pooler_output, out_ref.pooler_output)
    assert torch.equal(out.last_hidden_state, out_ref.last_hidden_state)
    # another seed initialises another pooler (it is not read from anywhere)
    other = _fp8(AutoModel, tmp_path, scheme, seed=4)
    assert not torch.equal(other.pooler.dense.weight_scale, model.pooler.dense.weight_scale)
    assert "pooler.dense" not in (model.config.quantization_config.modules_to_not_convert or [])


def test_config_with_more_layers_than_stored(tmp_path):
    folder = _llama(tmp_path / "llama")
    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 3
    ref = _reference(AutoModelForCausalLM, folder, "dynamic", seed=5, config=config)
    model = _fp8(AutoModelForCausalLM, folder, "dynamic", seed=5, config=config)
    assert isinstance(model.model.layers[2].mlp.down_proj, Fp8Linear)
    _same_layers(model, ref)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("intermediate", [128, 96])
def test_ignore_mismatched_sizes_reinitialises_the_resized_layers(intermediate, tmp_path):
    folder = _llama(tmp_path / "llama")
    config = AutoConfig.from_pretrained(folder)
    config.intermediate_size = intermediate
    kwargs = dict(config=config, ignore_mismatched_sizes=True)
    ref = _reference(AutoModelForCausalLM, folder, "dynamic", seed=7, **kwargs)
    model = _fp8(AutoModelForCausalLM, folder, "dynamic", seed=7, **kwargs)
    assert model.model.layers[0].mlp.up_proj.weight.shape == (intermediate, 64)
    _same_layers(model, ref)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_resized_layer_without_ignore_mismatched_sizes_fails_as_the_float_model(tmp_path):
    folder = _llama(tmp_path / "llama")
    config = AutoConfig.from_pretrained(folder)
    config.intermediate_size = 96
    with pytest.raises(Exception) as float_err:
        AutoModelForCausalLM.from_pretrained(folder, config=config)
    with pytest.raises(Exception) as fp8_err:
        _fp8(AutoModelForCausalLM, folder, "dynamic", seed=0, config=config)
    assert type(fp8_err.value) is type(float_err.value)
    assert str(fp8_err.value) == str(float_err.value)  # transformers' own size-mismatch error


def test_encoder_checkpoint_as_decoder_quantizes_the_new_cross_attention(tmp_path):
    # what EncoderDecoderModel.from_encoder_decoder_pretrained(decoder_quantization_config=...)
    # does for its decoder: the encoder checkpoint has no crossattention
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    from transformers import BertModel

    BertModel(config).save_pretrained(tmp_path)
    kwargs = dict(is_decoder=True, add_cross_attention=True)
    ref = _reference(BertModel, tmp_path, "dynamic", seed=11, **kwargs)
    model = _fp8(BertModel, tmp_path, "dynamic", seed=11, **kwargs)
    assert isinstance(model.encoder.layer[0].crossattention.self.query, Fp8Linear)
    _same_layers(model, ref)
    hidden = torch.randn(1, 5, 32)
    with torch.no_grad():
        out = model(IDS, encoder_hidden_states=hidden).last_hidden_state
        out_ref = ref(IDS, encoder_hidden_states=hidden).last_hidden_state
    assert torch.equal(out, out_ref)


def test_bin_checkpoint_lacking_a_layer_names_the_ways_out(tmp_path):
    # a .bin checkpoint: its shapes are not read, so the new pooler cannot be initialised first
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = BertForMaskedLM(config)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert isinstance(AutoModel.from_pretrained(tmp_path).pooler.dense, torch.nn.Linear)
    with pytest.raises(ValueError, match=r"high-precision checkpoint lacks.*pooler\.dense") as err:
        _fp8(AutoModel, tmp_path, "dynamic", seed=0)
    assert "safetensors" in str(err.value) and "modules_to_not_convert" in str(err.value)
    # the second way out it names: keep the new layer in high precision
    kept = AutoModel.from_pretrained(
        tmp_path, quantization_config=Fp8Config("dynamic", modules_to_not_convert=["pooler"])
    )
    assert type(kept.pooler.dense) is torch.nn.Linear
