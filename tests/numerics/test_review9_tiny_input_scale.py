"""Reviewer R14 finding 1: a static activation scale far below anything calibration makes
(``1e-45``: > 0 and finite) was accepted by ``Fp8Config``, ``hf-fp8 quantize
--activation-scale``, ``Fp8Linear`` / ``Fp8Experts`` and a checkpoint's ``input_scale``, and
the logits came out NaN. Input scales now have a lower bound, ``min_input_scale(fp8 dtype)
= AMAX_EPS / fp8_max`` (the scale calibration gives an activation amax of 1e-12), refused
with an error naming the option or tensor, wherever the upper bound is refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.cli import main
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics import amax_to_scale
from hf_fp8.numerics.checks import CheckpointTensorError, check_scale_tensor, min_input_scale
from tests.modules.moe_zoo import build_tiny, experts_classes
from tests.tiny_models import tiny_model_dir  # noqa: F401

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KEY = "model.layers.0.mlp.down_proj.input_scale"
QWEN3 = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")


def test_the_bound_is_the_calibration_floor_and_admits_what_calibration_stores():
    assert min_input_scale(E4M3) == pytest.approx(1e-12 / 448, rel=1e-5)
    assert min_input_scale(E5M2) == pytest.approx(1e-12 / 57344, rel=1e-5)
    for f8, top in ((E4M3, 448.0), (E5M2, 57344.0)):
        stored = [
            amax_to_scale(torch.tensor([1e-12]), f8),  # float32 division, as calibrate
            torch.tensor([1e-12 / top], dtype=torch.float32),  # old checkpoints
        ]
        for s in stored:
            check_scale_tensor("s", s, shape=(1,), min_value=min_input_scale(f8))
    with pytest.raises(CheckpointTensorError, match=r"layer\.input_scale: 1\.4\d*e-45 is below"):
        check_scale_tensor(
            "layer.input_scale", torch.tensor([1e-45]), min_value=min_input_scale(E4M3)
        )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"activation_scale": 1e-45}, "activation_scale"),
        ({"activation_scale": 1e-30}, "activation_scale"),
        ({"activation_scale": 1e-16}, "activation_scale"),  # fine for e5m2, not e4m3
        ({"activation_scales": {"model.layers.0.mlp.down_proj": 1e-40}}, "down_proj"),
    ],
)
def test_config_refuses_scales_below_the_bound_naming_them(kwargs, needle):
    with pytest.raises(ValueError, match=rf"{needle}.*below.*calibrate"):
        Fp8Config("static", **kwargs)


def test_config_accepts_the_bound_per_format():
    Fp8Config("static", activation_scale=float(amax_to_scale(torch.tensor([1e-12]), E4M3)))
    Fp8Config("static", fp8_format="e5m2", activation_scale=1e-16)
    with pytest.raises(ValueError, match=r"activation_scale.*below"):
        Fp8Config("static", fp8_format="e5m2", activation_scale=1e-17)


def test_cli_quantize_refuses_a_tiny_activation_scale(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    code = main(
        ["quantize", tiny_model_dir("llama"), "--scheme", "static",
         "--activation-scale", "1e-45", "--out", str(out)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "activation_scale" in err and "below" in err, err
    assert not out.exists()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fp8_linear_refuses_a_tiny_input_scale(device):
    with pytest.raises(ValueError, match=r"input_scale.*1e-45.*below"):
        Fp8Linear(16, 8, activation_scheme="static", device=device, input_scale=1e-45)
    layer = Fp8Linear(16, 8, activation_scheme="static", input_scale=0.5)
    layer.__dict__["fp8_name"] = "model.layers.0.mlp.down_proj"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj.*below"):
        layer.set_input_scale(torch.tensor([1e-45]))
    assert float(layer.input_scale) == 0.5  # left as it was


def test_fp8_linear_load_state_dict_refuses_a_tiny_input_scale():
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(16, 8), Fp8Config("static", activation_scale=0.5))
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    state["input_scale"] = torch.tensor([1e-45])
    with pytest.raises(CheckpointTensorError, match=r"input_scale: .*below"):
        layer.load_state_dict(state)


@pytest.fixture(scope="module")
def tiny_scale_checkpoint(tiny_model_dir, tmp_path_factory):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", activation_scale=0.05)
    )
    path = tmp_path_factory.mktemp("tiny_input_scale")
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors[KEY] = torch.full_like(tensors[KEY], 1e-45)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checkpoint_with_a_tiny_input_scale_is_refused_naming_it(tiny_scale_checkpoint, dtype):
    with pytest.raises(CheckpointTensorError, match=rf"{KEY}: 1\.4\d*e-45 is below"):
        AutoModelForCausalLM.from_pretrained(tiny_scale_checkpoint, dtype=dtype)


def test_experts_through_the_config_are_refused():
    with pytest.raises(ValueError, match=r"activation_scale.*below"):
        Fp8Experts.from_experts(build_tiny(QWEN3), Fp8Config("static", activation_scale=1e-45))


def test_experts_set_input_scale_refuses_a_tiny_scale():
    experts = Fp8Experts.from_experts(build_tiny(QWEN3), Fp8Config("static", activation_scale=0.1))
    with pytest.raises(ValueError, match=r"down_proj.*below"):
        experts.set_input_scale("down_proj", torch.full((experts.num_experts,), 1e-45))


def test_loaded_experts_with_a_tiny_input_scale_are_refused_naming_it():
    from hf_fp8.quantizer.validation import validate_loaded_model

    model = torch.nn.Module()
    model.experts = Fp8Experts.from_experts(
        build_tiny(QWEN3), Fp8Config("static", activation_scale=0.1)
    )
    model.experts.down_proj_input_scale.data[1] = 1e-45
    with pytest.raises(CheckpointTensorError, match=r"experts\.down_proj_input_scale: .*below"):
        validate_loaded_model(model)
