"""Reviewer R31 F5, F7 for the experts: ``torch.func.grad`` and double backward run FP8
experts as the dequantized module (the reference, float64), ``vmap`` is refused with what to
do instead (it failed deep in torch with an in-place broadcast error), and a static experts
module without input scales names itself and the ``activation_scales`` keys to give."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.jetmoe.modeling_jetmoe import JetMoeParallelExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts


def _source() -> nn.Module:
    torch.manual_seed(0)
    src = Qwen3MoeExperts(tf.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4))
    for p in src.parameters():  # the class leaves its weights uninitialized
        nn.init.normal_(p, std=0.1)
    return src


def _inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=gen)
    index = torch.randint(0, 4, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    return x, index, weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_func_grad_and_double_backward_equal_the_dequantized_experts() -> None:
    fp8 = Fp8Experts.from_experts(copy.deepcopy(_source()), Fp8Config("weight_only"))
    reference = fp8.dequantize().double()
    for p in reference.parameters():
        p.requires_grad_(False)
    x, index, weights = _inputs()
    got = torch.func.grad(lambda i: fp8(i, index, weights).pow(2).sum())(x)
    xr = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(reference(xr, index, weights.double()).pow(2).sum(), xr)
    assert _rel(got, want) < 1e-5
    results = []
    for module, dtype in ((fp8, torch.float32), (reference, torch.float64)):
        xi = x.detach().to(dtype).requires_grad_(True)
        out = module(xi, index, weights.to(dtype))
        (g,) = torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        g.pow(2).sum().backward()
        results.append(xi.grad)
    assert _rel(results[0], results[1]) < 1e-4


def test_vmap_is_refused_with_what_to_do() -> None:
    fp8 = Fp8Experts.from_experts(_source(), Fp8Config("weight_only"), module_name="mlp.experts")
    x, index, weights = _inputs()
    with pytest.raises(NotImplementedError, match=r"mlp\.experts: torch\.func\.vmap.*one batch"):
        torch.func.vmap(lambda i: fp8(i, index, weights))(x.expand(3, 6, 16))


def test_static_experts_without_scales_name_the_keys() -> None:
    fp8 = Fp8Experts.from_experts(_source(), Fp8Config("static"), module_name="mlp.experts")
    x, index, weights = _inputs()
    with pytest.raises(
        RuntimeError, match=r"mlp\.experts have no input scales.*'mlp\.experts\.down_proj'"
    ):
        fp8(x, index, weights)
    source = JetMoeParallelExperts(4, 16, 24)
    with torch.no_grad():  # its weight is torch.empty: uninitialised memory may hold NaN
        source.weight.normal_(0.0, 0.02)
    parallel = Fp8ParallelExperts.from_experts(source, Fp8Config("static"))
    with pytest.raises(RuntimeError, match=r"no input scales for \['weight'\].*activation_scales"):
        parallel(torch.randn(4, 16), [1, 1, 1, 1])
