"""calibrate() on static layers whose recipe asks ``kernel="scaled_mm"`` (the GPU setting).

Calibration observes high-precision activations by running each static layer weight-only;
switching the scheme alone kept ``kernel="scaled_mm"``, which the recipe refuses together
with weight-only: every static scaled_mm model failed to calibrate ("kernel='scaled_mm'
needs FP8 activations"). The observing recipe also takes a kernel that allows it, and the
layers get their original recipe objects back, on success and on error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.fp8_experts import Fp8Experts
from tests.calibration.test_calibrate_experts import QWEN3, _inputs, _Moe
from tests.modules.moe_zoo import build_tiny
from tests.tiny_models import model_inputs

BATCHES = [model_inputs("llama", seed=s) for s in range(2)]


def _static(tiny_model_dir, kernel: str) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=Fp8Config("static", kernel=kernel)
    )


def _recipes(model: nn.Module) -> dict[str, object]:
    return {n: m.recipe for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp8Experts))}


def test_scaled_mm_layers_calibrate_like_auto_ones(tiny_model_dir) -> None:
    """The reference: the same model with ``kernel="auto"`` (the observed activations do not
    depend on the kernel the layers will use afterwards)."""
    model = _static(tiny_model_dir, "scaled_mm")
    before = _recipes(model)
    scales = hf_fp8.calibrate(model, BATCHES, progress=False)
    reference = hf_fp8.calibrate(_static(tiny_model_dir, "auto"), BATCHES, progress=False)
    assert scales == reference
    after = _recipes(model)
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert {m.kernel for m in model.modules() if isinstance(m, Fp8Linear)} == {"scaled_mm"}


def test_recipes_are_restored_when_a_batch_fails(tiny_model_dir) -> None:
    model = _static(tiny_model_dir, "scaled_mm")
    before = _recipes(model)
    bad = {"input_ids": torch.full((1, 4), 10_000)}  # beyond the vocabulary: the forward raises
    with pytest.raises(IndexError):
        hf_fp8.calibrate(model, [BATCHES[0], bad], progress=False)
    after = _recipes(model)
    assert all(after[n] is before[n] for n in before)


def test_scaled_mm_experts_calibrate_like_auto_ones() -> None:
    experts = {
        kernel: Fp8Experts.from_experts(build_tiny(QWEN3), Fp8Config("static", kernel=kernel))
        for kernel in ("scaled_mm", "auto")
    }
    recipe = experts["scaled_mm"].recipe
    batch = _inputs(experts["auto"])
    scales = {k: hf_fp8.calibrate(_Moe(e), [batch], progress=False) for k, e in experts.items()}
    assert scales["scaled_mm"] == scales["auto"]
    assert experts["scaled_mm"].recipe is recipe
