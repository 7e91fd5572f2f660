"""Reviewer R32 F2/F3: ``save_pretrained(state_dict=...)`` checked an FP8 layer's codes and
weight scale for dtype and shape, its input scale only for its values: an input scale of
shape ``[3]`` (the layer stores ``[1]``) was written and the reload failed with transformers'
size mismatch; an fp16 or int64 one was written and the reload refused it ("a scale must be
float32"); an fp8 or complex one failed with torch's raw ``NotImplementedError "gt_cpu"``.
Now each is refused before anything is written (``StateDictError`` naming the key and the fix):
float32, the shape the layer stores (``[1]`` for ``Fp8Linear``, ``[E]`` for experts), then
values the reload accepts.

References: the reload of what a consistent state dict writes (the value put in), and the
checks the loader applies to the same tensor (``check_scale_tensor`` refuses it at reload)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.hub.hooks import StateDictError
from hf_fp8.numerics.checks import CheckpointTensorError, check_scale_tensor
from tests.serialization.moe_fixtures import tiny_qwen3_moe

Q = "model.layers.0.self_attn.q_proj"
KEY = f"{Q}.input_scale"
EXPERTS = "model.layers.0.mlp.experts"
EKEY = f"{EXPERTS}.down_proj_input_scale"


@pytest.fixture(scope="module")
def static_llama(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", activation_scale=0.02)
    )


BAD = {
    "shape3": (lambda: torch.full((3,), 0.02), "shape (3,)"),
    "scalar": (lambda: torch.tensor(0.02), "shape ()"),
    "fp16": (lambda: torch.tensor([0.02], dtype=torch.float16), "float16"),
    "bf16": (lambda: torch.tensor([0.02], dtype=torch.bfloat16), "bfloat16"),
    "fp64": (lambda: torch.tensor([0.02], dtype=torch.float64), "float64"),
    "int64": (lambda: torch.tensor([1]), "int64"),
    "fp8": (lambda: torch.tensor([0.02]).to(torch.float8_e4m3fn), "float8_e4m3fn"),
    "complex": (lambda: torch.tensor([0.02], dtype=torch.complex64), "complex64"),
    "wrong_shape_fp8": (lambda: torch.zeros(3).to(torch.float8_e4m3fn), "float8_e4m3fn"),
    "tiny": (lambda: torch.tensor([1e-30]), "below the smallest input scale"),
    "huge": (lambda: torch.tensor([1e30]), "exceeds the largest input scale"),
    "nan": (lambda: torch.tensor([float("nan")]), "positive finite"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_scale_is_refused_before_writing(static_llama, tmp_path, case):
    make, problem = BAD[case]
    value = make()
    model = static_llama
    # the reference: the loader's own check refuses this tensor for this layer
    with pytest.raises((CheckpointTensorError, RuntimeError)):
        check_scale_tensor(KEY, value, shape=(1,), max_value=1e16, min_value=1e-15)
        if value.dim() == 0:  # the loader's size check: a [1] parameter takes no scalar
            raise RuntimeError("size mismatch")
    sd = dict(model.state_dict())
    sd[KEY] = value
    before = model.get_submodule(Q).input_scale.clone()
    dest = tmp_path / "out"
    with pytest.raises(StateDictError) as err:
        model.save_pretrained(dest, state_dict=sd)
    message = str(err.value)
    assert KEY in message and problem in message
    if case not in ("tiny", "huge", "nan"):
        assert "float32 of shape (1,)" in message  # what the layer stores
    assert "model.state_dict()" in message  # the fix
    assert not dest.exists()
    assert torch.equal(model.get_submodule(Q).input_scale, before)


def test_float32_input_scale_of_the_layers_shape_reloads_as_put_in(static_llama, tmp_path):
    sd = dict(static_llama.state_dict())
    sd[KEY] = torch.tensor([0.0375])
    static_llama.save_pretrained(tmp_path, state_dict=sd)
    assert torch.equal(load_file(tmp_path / "model.safetensors")[KEY], torch.tensor([0.0375]))
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(back.get_submodule(Q).input_scale, torch.tensor([0.0375]))


def test_uncalibrated_static_layer_takes_a_float32_scale_of_shape_1(tiny_model_dir, tmp_path):
    """A static layer without a scale yet: ``[1]`` float32 is what it reloads."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static")
    )
    assert model.get_submodule(Q).input_scale is None
    sd = dict(model.state_dict())
    sd[KEY] = torch.full((3,), 0.03)
    with pytest.raises(StateDictError, match=r"shape \(3,\)"):
        model.save_pretrained(tmp_path / "bad", state_dict=sd)
    assert not (tmp_path / "bad").exists()
    sd[KEY] = torch.tensor([0.03])
    model.save_pretrained(tmp_path / "good", state_dict=sd)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "good")
    assert torch.equal(back.get_submodule(Q).input_scale, torch.tensor([0.03]))


@pytest.fixture(scope="module")
def static_moe():
    return hf_fp8.quantize_model(tiny_qwen3_moe(), Fp8Config("static", activation_scale=0.02))


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (torch.tensor([0.02]), "shape (1,)"),
        (torch.full((4,), 0.02, dtype=torch.float16), "float16"),
        (torch.full((4,), 0.02).to(torch.float8_e4m3fn), "float8_e4m3fn"),
    ],
)
def test_bad_experts_input_scale_is_refused_before_writing(static_moe, tmp_path, value, problem):
    sd = dict(static_moe.state_dict())
    assert tuple(sd[EKEY].shape) == (4,)  # one scale per expert
    sd[EKEY] = value
    with pytest.raises(StateDictError) as err:
        static_moe.save_pretrained(tmp_path / "out", state_dict=sd)
    assert EKEY in str(err.value) and problem in str(err.value)
    assert "(4,)" in str(err.value) or "float32" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_experts_input_scale_of_shape_e_reloads_as_put_in(static_moe, tmp_path):
    sd = dict(static_moe.state_dict())
    value = torch.tensor([0.01, 0.02, 0.03, 0.04])
    sd[EKEY] = value
    static_moe.save_pretrained(tmp_path, state_dict=sd)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(back.get_submodule(EXPERTS).down_proj_input_scale, value)
