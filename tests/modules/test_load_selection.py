"""from_pretrained picks layers with the same predicate as quantize_model, and warns on typos."""

from __future__ import annotations

import pytest
from torch import nn
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import tiny_model_dir  # noqa: F401


def test_a_modules_to_not_convert_typo_is_warned_about(tiny_model_dir) -> None:  # noqa: F811
    config = Fp8Config("weight_only", modules_to_not_convert=["down_prj", "up_proj"])
    with pytest.warns(UserWarning, match=r"modules_to_not_convert \['down_prj'\] match"):
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model_dir("llama"), quantization_config=config
        )
    layer = model.model.layers[0].mlp
    assert type(layer.up_proj) is nn.Linear and isinstance(layer.down_proj, Fp8Linear)
    assert config.modules_to_not_convert == ["down_prj", "up_proj"]  # the user's object is kept
    saved = model.config.quantization_config
    assert saved is not config and {"up_proj", "lm_head"} <= set(saved.modules_to_not_convert)
