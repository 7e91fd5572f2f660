"""R25 F5: ``AlreadyQuantizedError`` (named by the README and ``quantize_model``'s docstring) is
public: ``hf_fp8.AlreadyQuantizedError`` and in ``hf_fp8.__all__``, like CheckpointTensorError."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_fp8
from hf_fp8.quantizer.convert import AlreadyQuantizedError


def test_already_quantized_error_is_exported():
    assert "AlreadyQuantizedError" in hf_fp8.__all__
    assert hf_fp8.AlreadyQuantizedError is AlreadyQuantizedError
    assert "AlreadyQuantizedError" in dir(hf_fp8)
    assert issubclass(hf_fp8.AlreadyQuantizedError, ValueError)


def test_catching_the_public_name_catches_a_second_quantization():
    model = nn.Sequential(nn.Linear(64, 64))
    hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"))
    with pytest.raises(hf_fp8.AlreadyQuantizedError):
        hf_fp8.quantize_model(model, hf_fp8.Fp8Config("static", activation_scale=0.1))
    assert model[0].weight.dtype == torch.float8_e4m3fn
