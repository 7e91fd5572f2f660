"""R36: ``save_pretrained(state_dict=...)`` read only plain tensors' values: a tensor subclass
holding a NaN or negative weight scale passed the check and was written, and the reload
refused it. Subclasses are now read through ``as_subclass(torch.Tensor)``; meta tensors and
DTensor shards still skip the value check (their values cannot be read here)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.hub.hooks import StateDictError, check_state_dict

KEY = "model.layers.0.self_attn.q_proj.weight_scale"


class Tagged(torch.Tensor):
    """A plain tensor subclass, as libraries wrap tensors."""


@pytest.fixture(scope="module")
def dynamic_llama(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("dynamic")
    )


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0.0, float("inf")])
def test_a_subclass_scale_the_reload_refuses_is_refused_before_writing(
    dynamic_llama, tmp_path, value
):
    sd = {k: v.detach().clone() for k, v in dynamic_llama.state_dict().items()}
    sd[KEY] = torch.full_like(sd[KEY], value).as_subclass(Tagged)
    with pytest.raises(StateDictError, match="not a finite positive number"):
        dynamic_llama.save_pretrained(tmp_path / "out", state_dict=sd)
    assert not (tmp_path / "out").exists()


def test_a_valid_subclass_scale_passes_the_check(dynamic_llama):
    sd = {k: v.detach().clone() for k, v in dynamic_llama.state_dict().items()}
    sd[KEY] = sd[KEY].as_subclass(Tagged)
    check_state_dict(dynamic_llama, sd)  # raises on a refusal
    assert type(sd[KEY]) is Tagged and bool((sd[KEY].as_subclass(torch.Tensor) > 0).all())
