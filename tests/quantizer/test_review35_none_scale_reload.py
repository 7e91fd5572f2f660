"""R35: hf-fp8 before the twelfth session saved ``activation_scales`` entries of ``None``
(accepted then); R31 F5's refusal of ``None`` made such checkpoints unloadable. A loaded
config drops them with a warning (the layers' scales are stored in the checkpoint), while a
config built by hand still refuses them."""

import json
import warnings

import pytest
import torch
import transformers as tf

import hf_fp8
from hf_fp8 import Fp8Config

Q = "model.layers.0.self_attn.q_proj"


def _static_checkpoint(path):
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=128,
    )
    model = hf_fp8.quantize_model(
        tf.LlamaForCausalLM(config), Fp8Config("static", activation_scale=0.05)
    )
    hf_fp8.calibrate(model, [torch.randint(0, 128, (1, 8))], progress=False)
    model.save_pretrained(path)
    return model


def test_a_saved_none_entry_is_dropped_and_the_checkpoint_reloads(tmp_path):
    model = _static_checkpoint(tmp_path)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
    # what an older hf-fp8 wrote for Fp8Config(..., activation_scales={Q: None})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["activation_scales"] = {Q: None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert any("None" in str(w.message) and Q in str(w.message) for w in caught)
    assert reloaded.config.quantization_config.activation_scales is None
    q_scale = reloaded.model.layers[0].self_attn.q_proj.input_scale
    assert torch.equal(q_scale, model.model.layers[0].self_attn.q_proj.input_scale)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)


def test_a_none_entry_given_by_hand_is_still_refused():
    with pytest.raises(ValueError, match=r"is None"):
        Fp8Config("static", activation_scale=0.05, activation_scales={Q: None})
    kept = Fp8Config.from_dict(
        {"activation_scheme": "static", "activation_scales": {Q: None, "other": 0.1}}
    )
    assert kept.activation_scales == {"other": 0.1}
