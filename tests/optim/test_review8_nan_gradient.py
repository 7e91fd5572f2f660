"""R8 finding 3: one NaN gradient element. torch.optim.AdamW makes that one weight NaN and
keeps a state that saves and reloads. Plain FP8 made its whole group of 128 weights NaN (the
group's absmax was NaN) and refused the state it wrote itself; the log format and COAT wrote a
NaN scale too (refused when saved right after the NaN step) and COAT and the log format reset
the other 127 moments of the group.

Now a NaN element is left out of its group's maximum in every format and stores the zero code
in both moments (fp8 and int8 codes have no NaN the state check would accept; that element's
weight is NaN anyway, as in torch, and its moments restart if the weight is repaired). The
scales stay finite, the rest of the group keeps its moments, and the state reloads.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.utils import native
from tests.bitwise import assert_states_bit_equal
from tests.optim.test_review8_log_inf_group import SPOT, spiked_run

IMPLEMENTATIONS = ["reference"] + (["cpu_kernel"] if native.compiler() else [])
FORMATS = {
    "coat": {},
    "plain": {"dynamic_range_expansion": False},
    "plain_sqrt": {"dynamic_range_expansion": False, "sqrt_second_moment": True},
    "e5m2": {"fp8_format": "e5m2"},
    "log": {"moment_format": "log"},
}


def nan_run(make, steps: int, cols: int = 256, nan: float = float("nan")):
    """Steps of a [64, cols] weight whose first gradient holds ``nan`` at SPOT."""
    return spiked_run(make, nan, steps=steps, cols=cols)


def state_of(opt):
    return opt.state[next(iter(opt.state))]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("steps", [1, 2])
def test_a_nan_gradient_makes_one_weight_nan_and_the_state_reloads(implementation, fmt, steps):
    kw = dict(lr=1e-3, **FORMATS[fmt])
    torch_p, torch_opt = nan_run(lambda ps: torch.optim.AdamW(ps, lr=1e-3), steps)
    p, opt = nan_run(lambda ps: AdamWFp8(ps, implementation=implementation, **kw), steps)
    bad = torch.isnan(p)
    assert int(bad.sum()) == 1 and bool(bad[SPOT]), int(bad.sum())  # plain was 128
    assert torch.equal(bad, torch.isnan(torch_p))
    st = state_of(opt)
    for key, value in st.items():
        if key.endswith(("_scale", "_exponent")):
            assert torch.isfinite(value).all(), key  # was NaN: the state was refused
    if steps == 1:  # the NaN element's moments restart: zero codes (-0 for a NaN's sign)
        for key in ("exp_avg_fp8", "exp_avg_sq_fp8"):
            code = int(st[key][SPOT].view(torch.uint8))
            assert code & 0x7F == 0, (key, code)
    fresh = AdamWFp8([torch.nn.Parameter(p.clone())], **kw)
    fresh.load_state_dict(opt.state_dict())  # the state check accepts what it wrote
    # the other weights follow torch AdamW; the spot's group keeps its first moments
    err = float((p - torch_p)[~bad].abs().max())
    assert err < 1e-3 * steps, err
    group = torch.zeros_like(bad)
    group[SPOT[0], :128] = True
    group[SPOT] = False
    m = opt.moments(next(iter(opt.state)))[0][group]
    torch_m = torch_opt.state[next(iter(torch_opt.state))]["exp_avg"][group]
    rel = float((m - torch_m).norm() / torch_m.norm())
    assert rel < 0.2, rel  # COAT and the log format reset the group (rel = 1)


def _bit_run(implementation: str, fmt: str, nan: float, group_size: int, sr):
    return nan_run(
        lambda ps: AdamWFp8(
            ps,
            lr=1e-3,
            group_size=group_size,
            stochastic_rounding=sr,
            implementation=implementation,
            **FORMATS[fmt],
        ),
        steps=3,
        cols=200,
        nan=nan,
    )


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("nan", [float("nan"), -float("nan")], ids=["+nan", "-nan"])
@pytest.mark.parametrize(("group_size", "sr"), [(128, "exp_avg_sq"), (48, True), (7, False)])
def test_kernel_writes_the_reference_bits_after_a_nan_gradient(fmt, nan, group_size, sr):
    pa, oa = _bit_run("reference", fmt, nan, group_size, sr)
    pb, ob = _bit_run("cpu_kernel", fmt, nan, group_size, sr)
    assert torch.equal(torch.isnan(pa), torch.isnan(pb)) and int(torch.isnan(pa).sum()) == 1
    ok = ~torch.isnan(pa)
    assert torch.equal(pa[ok].view(torch.int32), pb[ok].view(torch.int32))
    assert_states_bit_equal(state_of(oa), state_of(ob))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["plain", "log"])
def test_compiled_step_writes_the_reference_bits_after_a_nan_gradient(fmt):
    pa, oa = _bit_run("reference", fmt, float("nan"), 128, True)
    pb, ob = _bit_run("compile", fmt, float("nan"), 128, True)
    assert ob.implementation == "compile"  # no fallback to the reference
    ok = ~torch.isnan(pa)
    assert torch.equal(torch.isnan(pa), torch.isnan(pb))
    assert torch.equal(pa[ok].view(torch.int32), pb[ok].view(torch.int32))
    assert_states_bit_equal(state_of(oa), state_of(ob))
