"""Gap 12.2: an experts module shared under two names (``layers[1].mlp.experts =
layers[0].mlp.experts``) loaded through ``from_pretrained`` took the config's input scale of
its first name only: ``activation_scales`` keyed by the second name was ignored (0.02, the
fallback, instead of 0.5), and two different entries kept the first one's without a word.
``quantize_model`` follows "the entry of whichever name has one; different entries are
refused" since R27 F3; ``from_pretrained`` now does too, on the fly and for a checkpoint
saved before calibration (no stored scale: the config's applies).

References: the values the config gives (``torch.full``), and the unshared float model."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.serialization.moe_fixtures import tiny_qwen3_moe

FIRST = "model.layers.0.mlp.experts"
ALIAS = "model.layers.1.mlp.experts"


class SharedMoe(tf.Qwen3MoeForCausalLM):
    """Qwen3-MoE whose second layer calls the first layer's experts."""

    def __init__(self, config):
        super().__init__(config)
        self.model.layers[1].mlp.experts = self.model.layers[0].mlp.experts


@pytest.fixture(scope="module")
def hp_dir(tmp_path_factory):
    """A high-precision checkpoint whose two layers hold the same experts (as shared)."""
    model = tiny_qwen3_moe()
    model.model.layers[1].mlp.experts.load_state_dict(
        model.model.layers[0].mlp.experts.state_dict()
    )
    path = tmp_path_factory.mktemp("shared_moe") / "hp"
    model.save_pretrained(path)
    return path


def _experts(model) -> Fp8Experts:
    experts = model.get_submodule(ALIAS)
    assert isinstance(experts, Fp8Experts)
    assert experts is model.get_submodule(FIRST)  # still one module
    return experts


def _full(value: float) -> torch.Tensor:
    return torch.full((4,), value, dtype=torch.float32)


def test_scale_keyed_by_the_second_name_applies(hp_dir):
    config = Fp8Config(
        "static", activation_scale=0.02, activation_scales={f"{ALIAS}.down_proj": 0.5}
    )
    experts = _experts(SharedMoe.from_pretrained(hp_dir, quantization_config=config))
    assert torch.equal(experts.down_proj_input_scale, _full(0.5))
    assert torch.equal(experts.gate_up_proj_input_scale, _full(0.02))  # no entry: fallback


def test_scale_keyed_by_the_second_name_without_fallback_applies(hp_dir):
    config = Fp8Config("static", activation_scales={f"{ALIAS}.down_proj": 0.5})
    experts = _experts(SharedMoe.from_pretrained(hp_dir, quantization_config=config))
    assert torch.equal(experts.down_proj_input_scale, _full(0.5))
    assert experts.gate_up_proj_input_scale is None  # nothing given: calibrate later


def test_equal_entries_under_both_names_apply(hp_dir):
    scales = {f"{FIRST}.down_proj": 0.25, f"{ALIAS}.down_proj": 0.25}
    config = Fp8Config("static", activation_scale=0.02, activation_scales=scales)
    experts = _experts(SharedMoe.from_pretrained(hp_dir, quantization_config=config))
    assert torch.equal(experts.down_proj_input_scale, _full(0.25))


def test_different_entries_under_both_names_are_refused(hp_dir):
    first, alias = f"{FIRST}.down_proj", f"{ALIAS}.down_proj"
    config = Fp8Config("static", activation_scales={first: 0.001, alias: 0.5})
    with pytest.raises(ValueError, match="shared") as err:
        SharedMoe.from_pretrained(hp_dir, quantization_config=config)
    message = str(err.value)
    assert first in message and alias in message
    assert "Keep one of these keys, or give them the same value" in message


def test_checkpoint_saved_before_calibration_takes_the_second_names_scale(hp_dir, tmp_path):
    """Pre-quantized, no input_scale stored: the saved config's entry under the alias."""
    unshared = tf.AutoModelForCausalLM.from_pretrained(
        hp_dir, quantization_config=Fp8Config("static")
    )
    unshared.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["activation_scales"] = {f"{ALIAS}.down_proj": 0.5}
    config_file.write_text(json.dumps(config))
    experts = _experts(SharedMoe.from_pretrained(tmp_path))
    assert torch.equal(experts.down_proj_input_scale, _full(0.5))
    assert experts.gate_up_proj_input_scale is None


def test_shared_model_runs_like_the_float_model(hp_dir):
    """The shared FP8 model (scales given under the alias) stays close to the float one."""
    scales = {f"{ALIAS}.down_proj": 0.05, f"{ALIAS}.gate_up_proj": 0.05}
    config = Fp8Config("static", activation_scale=0.05, activation_scales=scales)
    fp8 = SharedMoe.from_pretrained(hp_dir, quantization_config=config).eval()
    ref = SharedMoe.from_pretrained(hp_dir).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = fp8(ids).logits, ref(ids).logits
    assert float((got - want).norm() / want.norm()) < 0.1


# -- input scales stored under both names (saved from the unshared model) ---------------------


def _saved_unshared(hp_dir, folder, first: float, alias: float) -> None:
    """The unshared model, static, with these down_proj input scales per layer, saved."""
    model = tf.AutoModelForCausalLM.from_pretrained(
        hp_dir, quantization_config=Fp8Config("static", activation_scale=0.02)
    )
    model.get_submodule(FIRST).set_input_scale("down_proj", first)
    model.get_submodule(ALIAS).set_input_scale("down_proj", alias)
    model.save_pretrained(folder)


def test_different_stored_scales_under_both_names_are_refused(hp_dir, tmp_path):
    """The loader wrote both into the one tensor and kept the last (0.5): a guess."""
    _saved_unshared(hp_dir, tmp_path, 0.001, 0.5)
    with pytest.raises(CheckpointTensorError, match="shared") as err:
        SharedMoe.from_pretrained(tmp_path)
    message = str(err.value)
    assert f"{FIRST}.down_proj_input_scale" in message
    assert f"{ALIAS}.down_proj_input_scale" in message
    assert "Keep one of these tensors" in message


def test_equal_stored_scales_under_both_names_load(hp_dir, tmp_path):
    _saved_unshared(hp_dir, tmp_path, 0.25, 0.25)
    experts = _experts(SharedMoe.from_pretrained(tmp_path))
    assert torch.equal(experts.down_proj_input_scale, _full(0.25))
    assert torch.equal(experts.gate_up_proj_input_scale, _full(0.02))


def test_different_stored_scales_of_a_shared_linear_are_refused(tiny_model_dir, tmp_path):
    """The same rule for an ``Fp8Linear`` shared under two names."""

    class SharedLlama(tf.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.model.layers[1].mlp.down_proj = self.model.layers[0].mlp.down_proj

    first, alias = "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"
    model = tf.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", activation_scale=0.02)
    )
    model.get_submodule(first).set_input_scale(0.001)
    model.get_submodule(alias).set_input_scale(0.5)
    model.save_pretrained(tmp_path)
    with pytest.raises(CheckpointTensorError, match="shared") as err:
        SharedLlama.from_pretrained(tmp_path)
    assert f"{first}.input_scale" in str(err.value) and f"{alias}.input_scale" in str(err.value)
