"""R34 F3: ``calibrate`` on a ``torch.compile``'d model (``fullgraph=True``) runs its batches
eagerly: the same scales and logits as calibrating the eager model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

import hf_fp8
from hf_fp8.utils.tiny import tiny_llama_config

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
CALIB = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(64, 2, 32))
    hf_fp8.quantize_model(
        model, hf_fp8.Fp8Config("static", activation_scale=0.05), skip=["lm_head"]
    )
    return model.eval()


@pytest.mark.parametrize("observer", ["minmax", "percentile"])
def test_calibrate_fullgraph_compiled_forward_equals_eager(observer):
    eager = _model()
    reference = hf_fp8.calibrate(eager, CALIB, observer=observer, progress=False)
    model = _model()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        model(IDS)  # a warm-up: the compiled graph exists before calibration
    scales = hf_fp8.calibrate(model, CALIB, observer=observer, progress=False)
    assert scales == reference
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, eager(IDS).logits)


def test_calibrate_fullgraph_compiled_module_equals_eager():
    eager = _model()
    reference = hf_fp8.calibrate(eager, CALIB, progress=False)
    model = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    scales = hf_fp8.calibrate(compiled, CALIB, progress=False)
    assert {k.removeprefix("_orig_mod."): v for k, v in scales.items()} == reference
    with torch.no_grad():
        assert torch.equal(compiled(IDS).logits, eager(IDS).logits)
