"""Every supported family: FP8 from_pretrained stays close to the original; save → reload exact."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.bitwise import assert_states_bit_equal
from tests.tiny_models import TINY, model_inputs, model_output

AUTO = {"bert": AutoModel, "t5": AutoModelForSeq2SeqLM}

# Relative L2 error of logits / hidden states vs the unquantized model. E4M3 keeps 3 mantissa
# bits (relative rounding ≤ 2^-4 per element); through two random layers the output error
# measured ~2-4 % for weight-only and ~3-6 % with FP8 activations.
BOUND = {"weight_only": 0.06, "dynamic": 0.09, "static": 0.09}


def _auto(family):
    return AUTO.get(family, AutoModelForCausalLM)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("scheme", ["weight_only", "dynamic", "static"])
def test_family_close_to_original_and_reloads_exactly(family, scheme, tiny_model_dir, tmp_path):
    path = tiny_model_dir(family)
    inputs = model_inputs(family)
    reference = model_output(_auto(family).from_pretrained(path).eval(), inputs)
    config = Fp8Config(scheme, activation_scale=0.02 if scheme == "static" else None)
    model = _auto(family).from_pretrained(path, quantization_config=config)
    if scheme == "static":
        hf_fp8.calibrate(model, [model_inputs(family, seed=s) for s in range(1, 4)], progress=False)

    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8_layers) >= 4 * 2  # every block's projections are FP8
    out = model_output(model, inputs)
    assert _rel_err(out, reference) < BOUND[scheme]

    model.save_pretrained(tmp_path)
    reloaded = _auto(family).from_pretrained(tmp_path)
    assert_states_bit_equal(model, reloaded)
    assert torch.equal(model_output(reloaded, inputs), out)
    assert AutoConfig.from_pretrained(tmp_path).dtype == torch.float32


def test_gpt2_conv1d_layers_are_quantized(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("gpt2"), quantization_config=Fp8Config("weight_only")
    )
    attn = model.transformer.h[0].attn
    assert isinstance(attn.c_attn, Fp8Linear)
    assert (attn.c_attn.in_features, attn.c_attn.out_features) == (64, 192)
    # the tied output embedding stays in high precision
    assert type(model.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compute_dtype_follows_load_dtype(dtype, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=dtype, quantization_config=Fp8Config("dynamic")
    )
    layer = model.model.layers[0].mlp.up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32
    assert layer.compute_dtype == dtype
    out = model(**model_inputs("llama")).logits
    assert out.dtype == dtype and torch.isfinite(out).all()
