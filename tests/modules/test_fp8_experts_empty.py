"""FP8 MoE experts on an empty batch (review R2 F3): the output has the shape and dtype of the
high-precision module's own output on the same empty input, for every experts implementation,
scheme and weight granularity; no crash in ``reshape(0, -1)``."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hf_fp8 import Fp8Config
from hf_fp8.modules.fp8_bmm_experts import Fp8BmmExperts
from hf_fp8.modules.fp8_experts import Fp8Experts
from tests.modules.moe_zoo import build_tiny, routed_inputs
from tests.modules.test_fp8_experts import _DECODER, FAMILIES, MODELS, _swap

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def _config(scheme: str, gran: str) -> Fp8Config:
    return Fp8Config(
        scheme,
        weight_granularity=gran,
        block_size=(16, 16),
        activation_scale=0.05 if scheme == "static" else None,
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("scheme", ["dynamic", "static", "weight_only"])
@pytest.mark.parametrize("gran", ["row", "tensor", "block"])
def test_empty_batch_matches_the_high_precision_experts(name, scheme, gran) -> None:
    source = build_tiny(FAMILIES[name])
    fp8 = Fp8Experts.from_experts(source, _config(scheme, gran), module_name="mlp.experts")
    x, index, weights = routed_inputs(fp8.layout.hidden_size, fp8.num_experts, tokens=0)
    assert index.shape == (0, 2)
    with torch.no_grad():
        expected = source(x, index, weights)
        for impl in IMPLEMENTATIONS:
            fp8.config._experts_implementation = impl
            got = fp8(x, index, weights)
            assert (got.shape, got.dtype) == (expected.shape, expected.dtype), impl
    assert expected.shape == (0, fp8.layout.hidden_size)


def test_empty_batch_in_bfloat16_and_with_gradients() -> None:
    source = build_tiny(FAMILIES["Qwen3MoeExperts"])
    fp8 = Fp8Experts.from_experts(source, Fp8Config("dynamic")).to(torch.bfloat16)
    x, index, weights = routed_inputs(32, 6, tokens=0)
    x = x.bfloat16().requires_grad_(True)
    weights = weights.bfloat16().requires_grad_(True)
    out = fp8(x, index, weights)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    # as transformers' default (grouped_mm) experts: the empty output is on the graph
    source.config._experts_implementation = "grouped_mm"
    expected = source.to(torch.bfloat16)(x, index, weights)
    assert out.requires_grad == expected.requires_grad is True
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 32) and weights.grad.shape == (0, 2)
    # and a non-empty batch right after still routes (nothing cached from the empty one)
    x, index, weights = routed_inputs(32, 6, tokens=5)
    with torch.no_grad():
        assert fp8(x.bfloat16(), index, weights.bfloat16()).shape == (5, 32)


def _sparse_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(isinstance(c, Fp8Experts) for c in m.children())]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_empty_batch_through_the_models_own_moe_block(family) -> None:
    """The model's sparse MoE block (router + experts) on ``[0, seq, H]``, as the reviewer's
    Qwen3-MoE repro: the FP8 block returns the high-precision block's shape."""
    config_name, model_name, extra = MODELS[family]
    config = getattr(transformers, config_name)(**{**_DECODER, **extra})
    model = getattr(transformers, model_name)(config).eval()
    _swap(model, lambda m, n: Fp8Experts.from_experts(m, Fp8Config("dynamic"), module_name=n))
    block = _sparse_blocks(model)[0]
    x = torch.randn(0, 7, config.hidden_size)
    with torch.no_grad():
        got = block(x)
        got = got[0] if isinstance(got, tuple) else got
        _swap(model, lambda m, n: m.dequantize())
        expected = block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
    assert got.shape == expected.shape == (0, 7, config.hidden_size)
    assert got.dtype == expected.dtype


def test_empty_batch_of_bmm_experts_stays_supported() -> None:
    """Llama-4's bmm experts already handled an empty batch: kept that way."""
    from tests.modules.test_fp8_bmm_experts import _moe

    moe = _moe()
    x = torch.randn(0, 5, moe.hidden_dim)
    with torch.no_grad():
        expected = moe(x)
        moe.experts = Fp8BmmExperts.from_experts(moe.experts, Fp8Config("dynamic"))
        got = moe(x)
    expected, got = (t[0] if isinstance(t, tuple) else t for t in (expected, got))
    assert got.shape == expected.shape and got.dtype == expected.dtype
