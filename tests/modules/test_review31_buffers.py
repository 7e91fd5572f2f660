"""Reviewer R31 F4: the "plain linear" rule tested the truth value of the buffers
(``any(module.buffers())``), not whether there are any: a zero one-element buffer let the
layer convert (the buffer vanished from the model and its state_dict), a vector buffer
(torch's orthogonal parametrization, any subclass holding a mask) crashed quantize_model
with "Boolean value of Tensor ... ambiguous". The same test picked Llama-4-style bmm experts.
Reference: the float model, run before quantize_model."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn
from torch.nn.utils import parametrizations
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.modules import keep_reason
from hf_fp8.modules.fp8_bmm_experts import bmm_experts_layout


class ScalarBufferLinear(nn.Linear):  # inherits nn.Linear.forward
    def __init__(self, *args, start: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("calls", torch.tensor(start))


class VectorBufferLinear(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("mask", torch.ones(self.out_features))


class EmptyChildLinear(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extras = nn.ModuleList()  # len 0: falsy, yet a child


def _plain_with_buffer() -> nn.Linear:
    layer = nn.Linear(32, 32)
    layer.register_buffer("zero", torch.zeros(()))
    return layer


MAKERS = {
    "zero scalar buffer": lambda: ScalarBufferLinear(32, 32, start=0.0),
    "non-zero scalar buffer": lambda: ScalarBufferLinear(32, 32, start=1.0),
    "vector buffer": lambda: VectorBufferLinear(32, 32),
    "orthogonal parametrization": lambda: parametrizations.orthogonal(nn.Linear(32, 32)),
    "empty ModuleList child": lambda: EmptyChildLinear(32, 32),
    "nn.Linear with a registered buffer": _plain_with_buffer,
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_a_linear_holding_more_than_weight_and_bias_is_kept(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MAKERS[kind](), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = model(x)
    keys = set(model.state_dict())
    first = type(model[0])
    reason = keep_reason(model[0], "0", parent=model)
    assert reason is not None
    assert "Fp8Linear would not carry" in reason or "own behaviour" in reason
    hf_fp8.quantize_model(model, Fp8Config("weight_only"))
    assert type(model[0]) is first
    assert isinstance(model[2], hf_fp8.Fp8Linear)  # the plain layer still converts
    assert {k for k in model.state_dict() if k.startswith("0.")} == {
        k for k in keys if k.startswith("0.")
    }
    with torch.no_grad():
        got = model(x)
    assert float((got - want).norm() / want.norm()) < 0.05


def test_a_plain_linear_still_converts() -> None:
    model = nn.Sequential(nn.Linear(32, 32))
    assert keep_reason(model[0], "0", parent=model) is None


def _llama4_experts() -> nn.Module:
    torch.manual_seed(0)
    cfg = tf.Llama4TextConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    return Llama4TextExperts(cfg)


@pytest.mark.parametrize("buffer", [torch.zeros(()), torch.zeros(4), torch.ones(4)])
def test_bmm_experts_with_a_buffer_are_not_recognised(buffer: torch.Tensor) -> None:
    experts = _llama4_experts()
    assert bmm_experts_layout(experts) is not None  # the plain module is
    experts.register_buffer("counts", buffer)
    assert bmm_experts_layout(experts) is None
