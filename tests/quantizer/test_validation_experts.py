"""MoE experts inherit the load checks: ``validate_loaded_model`` covers ``Fp8Experts``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer.validation import validate_loaded_model
from tests.modules.moe_zoo import build_tiny, experts_classes

QWEN3 = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")


def _model(scheme: str = "dynamic", **kwargs) -> nn.Module:
    experts = Fp8Experts.from_experts(build_tiny(QWEN3), Fp8Config(scheme, **kwargs))
    model = nn.Module()
    model.experts = experts
    return model


def test_valid_experts_pass():
    """A valid FP8 experts model passes the checks; the same model with one NaN scale does not
    (so the check really runs over the experts)."""
    for model in (_model(), _model("static", activation_scale=0.1)):
        assert validate_loaded_model(model) is None
        experts = next(m for m in model.modules() if isinstance(m, Fp8Experts))
        experts.down_proj_weight_scale.data.view(-1)[0] = float("nan")
        with pytest.raises(CheckpointTensorError, match="down_proj_weight_scale"):
            validate_loaded_model(model)


@pytest.mark.parametrize(
    ("tensor", "corrupt", "pattern"),
    [
        ("down_proj_weight_scale", lambda t: t.fill_(float("nan")), "non-finite"),
        ("gate_up_proj_weight_scale", lambda t: t.zero_(), "must be > 0"),
        ("down_proj", lambda t: t.float(), "expected fp8 e4m3"),
        ("down_proj", lambda t: t.float().to(torch.float8_e5m2), "stored as fp8 e5m2"),
        ("down_proj_weight_scale", lambda t: t[:1].clone(), "expected scale shape"),
    ],
)
def test_bad_expert_tensors_are_named(tensor, corrupt, pattern):
    model = _model()
    param = getattr(model.experts, tensor)
    out = corrupt(param.data)
    setattr(model.experts, tensor, nn.Parameter(out, requires_grad=False))
    with pytest.raises(CheckpointTensorError, match=rf"experts\.{tensor}: .*{pattern}"):
        validate_loaded_model(model)


def test_static_expert_input_scale_is_checked():
    model = _model("static", activation_scale=0.1)
    model.experts.down_proj_input_scale.data[1] = 0.0
    with pytest.raises(CheckpointTensorError, match=r"experts\.down_proj_input_scale: .*> 0"):
        validate_loaded_model(model)


def test_stored_expert_tensors_are_checked_before_loading():
    from hf_fp8.quantizer.validation import check_stored_tensor

    e4m3 = torch.float8_e4m3fn
    check_stored_tensor("experts.down_proj", torch.zeros(2, 4, 4, dtype=e4m3), fp8_dtype=e4m3)
    check_stored_tensor("experts.down_proj_weight_scale", torch.ones(2, 4, 1), fp8_dtype=e4m3)
    with pytest.raises(CheckpointTensorError, match=r"experts\.down_proj: expected fp8 e4m3"):
        check_stored_tensor("experts.down_proj", torch.zeros(2, 4, 4), fp8_dtype=e4m3)
    with pytest.raises(CheckpointTensorError, match=r"down_proj_input_scale: .*> 0"):
        check_stored_tensor("experts.down_proj_input_scale", torch.zeros(2), fp8_dtype=e4m3)
