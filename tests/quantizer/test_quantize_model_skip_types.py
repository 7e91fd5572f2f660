"""``quantize_model(skip=...)`` takes module names as ``Fp8Config.modules_to_not_convert``
does: a list of non-empty strings. Before, ``skip="mlp"`` was read as ``['m', 'l', 'p']`` and
``skip=[""]`` matched the root module, so neither kept anything and neither warned."""

from __future__ import annotations

import pytest
import torch

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import TINY


def _llama():
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs)).eval()


@pytest.mark.parametrize(
    ("skip", "words"),
    [("mlp", "['mlp']"), ([""], "empty"), (["  "], "empty"), ([3], "not a str")],
)
def test_bad_skip_names_are_refused_before_anything_converts(skip, words):
    model = _llama()
    with pytest.raises(ValueError) as err:
        hf_fp8.quantize_model(model, Fp8Config("dynamic"), skip=skip)
    assert "skip" in str(err.value) and words in str(err.value)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def test_a_list_of_names_still_keeps_those_layers():
    model = hf_fp8.quantize_model(_llama(), Fp8Config("dynamic"), skip=("mlp",))
    kept = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert kept and all(".mlp." in n or n == "lm_head" for n in kept)
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
