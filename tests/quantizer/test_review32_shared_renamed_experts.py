"""Reviewer R32 F1: an experts module shared under two names (``layers[1].mlp.experts =
layers[0].mlp.experts``) of a model whose checkpoint names its modules otherwise (Mixtral saves
``block_sparse_moe.experts``, the model calls it ``mlp.experts``). A checkpoint saved from the
unshared model stores one input scale under each name; the loader writes both into the one
tensor and keeps the one it reads last (0.5 where 0.001 was stored too), silently, while the
same checkpoint of Qwen3-MoE (names not renamed) is refused
(tests/quantizer/test_gap12_shared_experts_from_pretrained.py). Now the stored names are
resolved as the loader renames them: different values are refused, naming both, equal ones
load.

References: the values stored (``torch.full``) and the checkpoint's own tensor names."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors import safe_open

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.tiny_models import tiny_mixtral

FIRST = "model.layers.0.mlp.experts"
ALIAS = "model.layers.1.mlp.experts"


class SharedMixtral(tf.MixtralForCausalLM):
    """Mixtral whose second layer calls the first layer's experts."""

    def __init__(self, config):
        super().__init__(config)
        self.model.layers[1].mlp.experts = self.model.layers[0].mlp.experts


@pytest.fixture(scope="module")
def hp_dir(tmp_path_factory):
    """A high-precision Mixtral checkpoint whose two layers hold the same experts."""
    torch.manual_seed(0)
    model = tiny_mixtral()
    model.model.layers[1].mlp.experts.load_state_dict(
        model.model.layers[0].mlp.experts.state_dict()
    )
    path = tmp_path_factory.mktemp("shared_mixtral") / "hp"
    model.save_pretrained(path)
    return path


def _saved_unshared(hp_dir, folder, first: float, alias: float) -> None:
    """The unshared model, static, with these down_proj input scales per layer, saved."""
    model = tf.AutoModelForCausalLM.from_pretrained(
        hp_dir, quantization_config=Fp8Config("static", activation_scale=0.02)
    )
    model.get_submodule(FIRST).set_input_scale("down_proj", first)
    model.get_submodule(ALIAS).set_input_scale("down_proj", alias)
    model.save_pretrained(folder)


def _stored(folder) -> dict[str, torch.Tensor]:
    """The down_proj input scales the checkpoint stores, by their stored names."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle)
                if name.endswith("down_proj_input_scale"):
                    out[name] = f.get_tensor(name)
    return out


def test_checkpoint_stores_the_experts_under_the_renamed_module(hp_dir, tmp_path):
    """The case of F1: neither stored name is the model's own name for the module."""
    _saved_unshared(hp_dir, tmp_path, 0.001, 0.5)
    stored = _stored(tmp_path)
    assert sorted(stored) == [
        "model.layers.0.block_sparse_moe.experts.down_proj_input_scale",
        "model.layers.1.block_sparse_moe.experts.down_proj_input_scale",
    ]
    assert not torch.equal(*stored.values())


def test_different_stored_scales_under_both_renamed_names_are_refused(hp_dir, tmp_path):
    """Before: loaded, the shared scale 0.5 (the one read last) and 0.001 dropped."""
    _saved_unshared(hp_dir, tmp_path, 0.001, 0.5)
    with pytest.raises(CheckpointTensorError, match="shared") as err:
        SharedMixtral.from_pretrained(tmp_path)
    message = str(err.value)
    assert f"{FIRST}.down_proj_input_scale" in message
    assert f"{ALIAS}.down_proj_input_scale" in message
    assert "model.layers.0.block_sparse_moe.experts.down_proj_input_scale" in message
    assert "model.layers.1.block_sparse_moe.experts.down_proj_input_scale" in message
    assert "Keep one of these tensors" in message


def test_equal_stored_scales_under_both_renamed_names_load(hp_dir, tmp_path):
    _saved_unshared(hp_dir, tmp_path, 0.25, 0.25)
    model = SharedMixtral.from_pretrained(tmp_path)
    experts = model.get_submodule(ALIAS)
    assert isinstance(experts, Fp8Experts) and experts is model.get_submodule(FIRST)
    assert torch.equal(experts.down_proj_input_scale, torch.full((4,), 0.25))
    assert torch.equal(experts.gate_up_proj_input_scale, torch.full((4,), 0.02))
