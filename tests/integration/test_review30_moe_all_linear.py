"""``target_modules="all-linear"`` on an FP8 MoE model (reviewer R30 t13): peft moves the experts
into ``target_parameters`` on its own, so the refusal of LoRA on FP8 experts says that
all-linear pulled them in (the user named no experts)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer

from hf_fp8 import Fp8Config, quantize_model
from tests.tiny_models import tiny_mixtral


def _fp8_mixtral():
    torch.manual_seed(0)
    model = quantize_model(tiny_mixtral(), Fp8Config("weight_only"))
    assert any(type(m).__name__ == "Fp8Experts" for m in model.modules())
    return model


def test_all_linear_refusal_says_it_pulled_in_the_experts():
    model = _fp8_mixtral()
    with pytest.raises(NotImplementedError, match="FP8 experts") as err:
        get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    message = str(err.value)
    assert message.startswith("target_modules='all-linear' pulled in the MoE experts")
    assert "target_modules=['q_proj'" in message  # the fix, as before
    assert not any(isinstance(m, BaseTunerLayer) for m in model.modules())


def test_experts_named_in_target_parameters_are_refused_without_the_note():
    model = _fp8_mixtral()
    config = LoraConfig(r=4, target_modules=[], target_parameters=["experts.gate_up_proj"])
    with pytest.raises(NotImplementedError, match="FP8 experts") as err:
        get_peft_model(model, config)
    assert "pulled in" not in str(err.value)
