"""hf_fp8 models of every scheme, stock loading, and exact comparisons."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from tests.tiny_models import model_inputs, model_output

# Every scheme hf_fp8 supports that the foreign formats can hold (tiny dims: 32×32 blocks).
SCHEMES: dict[str, dict] = {
    "dynamic-row-token": {"activation_scheme": "dynamic"},
    "dynamic-tensor-tensor": {
        "activation_scheme": "dynamic",
        "weight_granularity": "tensor",
        "activation_granularity": "tensor",
    },
    "dynamic-tensor-token": {"activation_scheme": "dynamic", "weight_granularity": "tensor"},
    "dynamic-row-block": {
        "activation_scheme": "dynamic",
        "activation_granularity": "block",
        "block_size": [32, 32],
    },
    "dynamic-block": {
        "activation_scheme": "dynamic",
        "weight_granularity": "block",
        "block_size": [32, 32],
    },
    "static-tensor": {"activation_scheme": "static", "weight_granularity": "tensor"},
    "static-row": {"activation_scheme": "static"},
    "static-block": {
        "activation_scheme": "static",
        "weight_granularity": "block",
        "block_size": [32, 32],
    },
    "weight_only-row": {"activation_scheme": "weight_only"},
    "weight_only-block": {
        "activation_scheme": "weight_only",
        "weight_granularity": "block",
        "block_size": [32, 32],
    },
}


def quantized(path: str, scheme: str, dtype: torch.dtype = torch.float32):
    """Tiny llama at ``path`` quantized with ``SCHEMES[scheme]`` (static: calibrated)."""
    kwargs = dict(SCHEMES[scheme])
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=Fp8Config(kwargs.pop("activation_scheme"), **kwargs)
    )
    if model.config.quantization_config.activation_scheme == "static":
        hf_fp8.calibrate(model, [model_inputs("llama", seed=s) for s in (1, 2, 3)], progress=False)
    return model


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model_output(model, model_inputs("llama", batch=2, seq=12, seed=7))


def stock_load(path) -> torch.nn.Module:
    """Load with transformers' own quantizer for the checkpoint's format (never hf_fp8's)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    # both are dropped when transformers dequantizes the weights at load time
    config = getattr(model.config, "quantization_config", None)
    assert config is None or type(config).__module__.startswith("transformers.")
    quantizer = getattr(model, "hf_quantizer", None)
    assert quantizer is None or type(quantizer).__module__.startswith("transformers.")
    return model


def fp32_close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference, asserted to be within fp32 rounding of ``want``'s scale."""
    diff = float((got - want).abs().max())
    assert diff <= 1e-5 * float(want.abs().max()), diff
    return diff
