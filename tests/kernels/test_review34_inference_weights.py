"""R34 F11: Fp8Linear weights created under ``torch.inference_mode()`` train eagerly (input
gradients, as LoRA needs) but a ``torch.compile``'d backward cannot save them: a clear error
naming the layer and the fix instead of torch's bare one; the fix it names works."""

from __future__ import annotations

import pytest
import torch

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.numerics import dequantize


def _inference_layer() -> Fp8Linear:
    torch.manual_seed(0)
    with torch.inference_mode():
        return Fp8Linear.from_linear(torch.nn.Linear(64, 48).to(torch.bfloat16), Fp8Config())


def _input() -> torch.Tensor:
    return torch.randn(2, 20, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))


def test_compiled_backward_of_inference_weights_names_layer_and_fix():
    layer = _inference_layer()
    assert layer.weight.is_inference()
    x = _input().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"Fp8Linear \(weight \(48, 64\)\)") as err:
        compiled(x).float().sum().backward()
    assert "torch.inference_mode()" in str(err.value)
    assert "torch.no_grad()" in str(err.value) and ".clone()" in str(err.value)


def test_the_named_fix_trains_compiled_like_the_dequantized_weight():
    layer = _inference_layer()
    with torch.no_grad():  # the fix the error names
        for m in [layer]:
            if isinstance(m, hf_fp8.Fp8Linear):
                m.weight = torch.nn.Parameter(m.weight.clone(), requires_grad=False)
                m.weight_scale = torch.nn.Parameter(m.weight_scale.clone(), requires_grad=False)
    assert not layer.weight.is_inference()
    x = _input().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(x).float().sum().backward()
    w = dequantize(layer.weight, layer.weight_scale, torch.float32, "row", (128, 128))
    reference = torch.ones(2, 20, 48) @ w  # d(sum(x @ w.T + b))/dx
    torch.testing.assert_close(x.grad.float(), reference, rtol=1e-2, atol=1e-2)
