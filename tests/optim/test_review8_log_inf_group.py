"""R8 finding 2: ``moment_format="log"``: one +inf gradient made ``m``'s group scale inf, so
every ``m`` of the group decoded to NaN (128 NaN weights where torch AdamW has 1), and the C
kernel (code -127) and the reference (code 0) disagreed on the inf element. A finite torch
AdamW state (``m = 3e38`` over ``v = 1e-30``) converted on load did the same. ``m·2^-e``'s group
maximum now saturates (at ``log_moments.M_MAX``): the element takes code ±127, every code
decodes finite, the state reloads, and reference, C kernel and compile agree.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.numerics import log_moments
from hf_fp8.optim import AdamWFp8
from hf_fp8.utils import native
from tests.bitwise import assert_bit_equal, assert_states_bit_equal

SPOT = (3, 7)
IMPLEMENTATIONS = ["reference"] + (["cpu_kernel"] if native.compiler() else [])


def spiked_run(make, value: float, steps: int = 2, cols: int = 256, seed: int = 0):
    """Steps of a [64, cols] weight; the first gradient holds ``value`` at SPOT."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(64, cols, generator=g))
    opt = make([p])
    for step in range(steps):
        grad = torch.randn(64, cols, generator=g)
        if step == 0:
            grad[SPOT] = value
        p.grad = grad
        opt.step()
    return p.detach(), opt


def reloads(opt: AdamWFp8, p: torch.Tensor, **kw) -> bool:
    fresh = AdamWFp8([torch.nn.Parameter(p.clone())], **kw)
    fresh.load_state_dict(opt.state_dict())  # raises OptimizerStateError when refused
    return True


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
@pytest.mark.parametrize("group_size", [128, 48])
def test_an_infinite_gradient_makes_one_weight_nonfinite_like_torch(
    implementation, value, group_size
):
    torch_p, _ = spiked_run(lambda ps: torch.optim.AdamW(ps, lr=1e-3), value)
    kw = dict(lr=1e-3, moment_format="log", group_size=group_size)
    for steps in (1, 2):
        p, opt = spiked_run(
            lambda ps: AdamWFp8(ps, implementation=implementation, **kw), value, steps
        )
        bad = ~torch.isfinite(p)
        assert int(bad.sum()) == 1 and bool(bad[SPOT]), int(bad.sum())  # was 128 (the group)
        st = opt.state[next(iter(opt.state))]
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.isfinite(st[key]).all(), key
        m, v = opt.moments(next(iter(opt.state)))
        assert torch.isfinite(m).all() and torch.isfinite(v).all()
        assert reloads(opt, p, **kw)
    assert int((~torch.isfinite(torch_p)).sum()) == 1
    # the other weights after 2 steps: as torch AdamW (the spiked group's m is lost for a step)
    ok = torch.isfinite(p)
    err = (p - torch_p)[ok].abs().max()
    assert float(err) < 5e-3, float(err)


def test_the_inf_element_takes_the_saturated_code():
    """quantize_m: ±inf (and finite values beyond M_MAX) code ±127 at a finite scale; the
    other codes of the group are as for a group whose maximum is M_MAX."""
    m = torch.linspace(-2.0, 2.0, 128).reshape(1, -1).clone()
    m[0, 5], m[0, 9] = float("inf"), -float("inf")
    q, scale = log_moments.quantize_m(m)
    assert float(scale[0]) == float(torch.tensor(log_moments.M_MAX) / 127)  # fp32
    assert int(q[0, 5]) == 127 and int(q[0, 9]) == -127
    assert (q[0, :5] == 0).all()
    decoded = log_moments.dequantize_m(q, scale, torch.full_like(m, 2.0**64))
    assert torch.isfinite(decoded).all()  # 127·scale·2^64 < FLT_MAX


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_converted_torch_state_with_a_huge_m_stays_finite(implementation):
    """A finite torch AdamW state whose m·2^-e overflows fp32 (m = 3e38 over v = 1e-30)."""
    g = torch.Generator().manual_seed(0)
    q = torch.nn.Parameter(torch.randn(64, 128, generator=g))
    ref = torch.optim.AdamW([q], lr=1e-3)
    q.grad = torch.randn(64, 128, generator=g)
    ref.step()
    sd = ref.state_dict()
    sd["state"][0]["exp_avg"][SPOT], sd["state"][0]["exp_avg_sq"][SPOT] = 3e38, 1e-30
    p = torch.nn.Parameter(q.detach().clone())
    kw = dict(lr=1e-3, moment_format="log", implementation=implementation)
    opt = AdamWFp8([p], **kw)
    with pytest.warns(RuntimeWarning, match="converted"):
        opt.load_state_dict(sd)
    st = opt.state[p]
    assert torch.isfinite(st["exp_avg_scale"]).all()
    assert torch.isfinite(opt.moments(p)[0]).all()
    p.grad = torch.randn(64, 128, generator=g)
    opt.step()
    assert torch.isfinite(p).all()  # was 128 NaN weights (torch: 0)
    assert reloads(opt, p, **kw)


def _bit_run(implementation: str, sr: bool, group_size: int, steps: int = 3):
    return spiked_run(
        lambda ps: AdamWFp8(
            ps,
            lr=1e-3,
            moment_format="log",
            stochastic_rounding=sr,
            group_size=group_size,
            implementation=implementation,
        ),
        float("inf"),
        steps=steps,
        cols=200,
    )


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("stochastic_rounding", [False, True])
@pytest.mark.parametrize("group_size", [128, 48, 7])  # AVX-512 loops, their tail, scalar
@pytest.mark.parametrize("steps", [1, 3])
def test_kernel_writes_the_reference_bits_after_an_inf_gradient(
    stochastic_rounding, group_size, steps
):
    pa, oa = _bit_run("reference", stochastic_rounding, group_size, steps)
    pb, ob = _bit_run("cpu_kernel", stochastic_rounding, group_size, steps)
    if steps == 1:  # the inf element's code (was -127 in C, 0 in the reference)
        assert int(oa.state[next(iter(oa.state))]["exp_avg_fp8"][SPOT]) == 127
    assert_bit_equal(pa, pb, "param")
    assert_states_bit_equal(oa.state[next(iter(oa.state))], ob.state[next(iter(ob.state))])


@pytest.mark.slow
def test_compiled_step_writes_the_reference_bits_after_an_inf_gradient():
    pa, oa = _bit_run("reference", True, 128)
    pb, ob = _bit_run("compile", True, 128)
    assert ob.implementation == "compile"  # no fallback to the reference
    assert_bit_equal(pa, pb, "param")
    assert_states_bit_equal(oa.state[next(iter(oa.state))], ob.state[next(iter(ob.state))])
