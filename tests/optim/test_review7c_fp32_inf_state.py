"""R5 finding 2: an fp32 second moment that overflowed to +inf is a state torch writes.

A gradient whose square overflows fp32 makes ``exp_avg_sq = inf`` in ``torch.optim.AdamW``
and in the fp32 moments AdamWFp8 keeps for small tensors; torch reloads such a state. The
state check refused it. It now accepts +inf (NaN and negative values are still refused), and
converting such a state to quantized moments saturates the group like a step does.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.optim._state_check import OptimizerStateError

SPIKE = 3


def spiked_torch_state(shape: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
    """A torch.optim.AdamW state after one step whose gradient has one 1e21 element."""
    p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.AdamW([p], lr=1e-3)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    g.view(-1)[SPIKE] = 1e21
    p.grad = g
    opt.step()
    v = opt.state[p]["exp_avg_sq"]
    assert torch.isinf(v.view(-1)[SPIKE]) and torch.isfinite(v).sum() == v.numel() - 1
    return p.detach().clone(), opt.state_dict()


def test_own_fp32_state_with_an_overflowed_v_reloads():
    """AdamWFp8 keeps a 1-D parameter's moments in fp32; after a spike its v is inf there,
    and the state it saved loads again (R5 fp32reload.py)."""
    p = torch.nn.Parameter(torch.zeros(256))
    opt = AdamWFp8([p], lr=1e-3)
    g = torch.full((256,), 1e-3)
    g[SPIKE] = 1e21
    p.grad = g
    opt.step()
    assert torch.isinf(opt.state[p]["exp_avg_sq"][SPIKE])
    other = AdamWFp8([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    other.load_state_dict(opt.state_dict())
    q = next(iter(other.state))
    assert torch.isinf(other.state[q]["exp_avg_sq"][SPIKE])


def test_torch_fp32_state_with_inf_v_continues_like_torch():
    """Loaded into fp32 moments, the inf stays (as in torch): the next steps follow
    torch.optim.AdamW, the overflowed element frozen in both."""
    p0, sd = spiked_torch_state((256,))
    ref = torch.nn.Parameter(p0.clone())
    t = torch.optim.AdamW([ref], lr=1e-3)
    t.load_state_dict(copy.deepcopy(sd))  # torch's state aliases the loaded tensors
    got = torch.nn.Parameter(p0.clone())
    o = AdamWFp8([got], lr=1e-3)
    o.load_state_dict(copy.deepcopy(sd))
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        grad = torch.randn(256, generator=g) * 1e-3
        ref.grad, got.grad = grad.clone(), grad.clone()
        t.step()
        o.step()
    assert torch.equal(got, ref)  # the fp32 path is torch's arithmetic
    decay_only = p0[SPIKE] * ((1 - 1e-3 * 1e-2) ** 3 - 1)  # lr·weight_decay, 3 steps
    assert float(((got - p0)[SPIKE] - decay_only).abs()) < 1e-7


@pytest.mark.parametrize(
    "options",
    [
        {"moment_format": "log"},
        {"moment_format": "fp8"},
        {"moment_format": "fp8", "sqrt_second_moment": True},
        {"moment_format": "fp8", "dynamic_range_expansion": False},
    ],
    ids=["log", "fp8", "fp8-sqrt_v", "fp8-plain"],
)
def test_torch_state_with_inf_v_converts_to_saturated_codes(options):
    """Converted to quantized moments: every stored tensor finite, the overflowed element's
    v decodes to > 1e38 (saturated, not lost, not NaN), the other elements of its group
    decode near torch's v, and the converted state saves and loads again."""
    p0, sd = spiked_torch_state((8, 256))
    p = torch.nn.Parameter(p0.clone())
    opt = AdamWFp8([p], lr=1e-3, min_quantize_numel=1, **options)
    opt.load_state_dict(sd)
    for key, value in opt.state[p].items():
        if value.is_floating_point():
            assert torch.isfinite(value.float()).all(), key
    v_torch = next(iter(sd["state"].values()))["exp_avg_sq"]
    v = opt.moments(p)[1]
    assert float(v[0, SPIKE]) > 1e38
    rest = torch.ones(128, dtype=torch.bool)
    rest[SPIKE] = False
    ratio = v[0, :128][rest].double() / v_torch[0, :128][rest].double()
    # the spike stretches the group to COAT's widest range: coarse codes (log: one per
    # octave; fp8: 3 mantissa bits under the power 16), but the right magnitude; plain absmax
    # fp8 has no range for 1e-7 under 3.4e38: those flush to zero
    if options.get("dynamic_range_expansion", True):
        octaves = 1.0 if options["moment_format"] == "log" else 3.0
        assert float((ratio.log2().abs()).max()) < octaves, ratio
    v.view(-1)[SPIKE] = 0.0  # sqrt_second_moment squares FLT_MAX: inf, as after a step
    assert torch.isfinite(v).all()
    again = AdamWFp8([torch.nn.Parameter(p0.clone())], lr=1e-3, min_quantize_numel=1, **options)
    again.load_state_dict(opt.state_dict())
    p.grad = torch.full_like(p, 1e-3)
    opt.step()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("-inf")])
def test_nan_and_negative_v_are_still_refused(bad):
    p0, sd = spiked_torch_state((256,))
    next(iter(sd["state"].values()))["exp_avg_sq"][5] = bad
    with pytest.raises(OptimizerStateError, match="exp_avg_sq"):
        AdamWFp8([torch.nn.Parameter(p0.clone())]).load_state_dict(sd)


def test_inf_first_moment_is_still_refused():
    p0, sd = spiked_torch_state((256,))
    next(iter(sd["state"].values()))["exp_avg"][5] = float("inf")
    with pytest.raises(OptimizerStateError, match="exp_avg"):
        AdamWFp8([torch.nn.Parameter(p0.clone())]).load_state_dict(sd)
