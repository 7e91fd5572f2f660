"""Loaded moment values are checked, not only their dtypes and shapes (reviewer R1 finding 3).

Each case is a state an optimizer never writes that the old check accepted and that made
weights NaN / inf after one step: negative second-moment codes, NaN / inf fp8 codes, a NaN
fp32 ``exp_avg``, scales so large that the decoded moment overflows fp32. The limits come
from the formats (fp8: ``|x̂| <= scale·F`` with F = 448 / 57344; log: ``|m̂| <= 127·scale·2^e``),
computed here from torch's own dtypes, not from the code under test.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.optim._state_check import OptimizerStateError

FLT_MAX = torch.finfo(torch.float32).max


def _trained(**options) -> tuple[list[torch.nn.Parameter], dict]:
    """A weight (quantized) and a bias (fp32 states) after one step, and the state dict."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(64))]
    opt = AdamWFp8(params, lr=1e-3, **options)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, copy.deepcopy(opt.state_dict())


def _load(params: list[torch.nn.Parameter], sd: dict, **options) -> AdamWFp8:
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = AdamWFp8(fresh, lr=1e-3, **options)
    opt.load_state_dict(sd)
    return opt


def _refused(params, sd, pid: int, key: str, **options) -> str:
    """The load's ``OptimizerStateError`` message (fails when the load is accepted)."""
    with pytest.raises(OptimizerStateError) as info:
        _load(params, sd, **options)
    return str(info.value)


def _names(message: str, pid: int, key: str) -> bool:
    """The error names the parameter, the tensor and the fix."""
    return (
        f"parameter {pid}" in message and repr(key) in message and "restart its moments" in message
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"fp8_format": "e5m2", "dynamic_range_expansion": False},
        {"sqrt_second_moment": True, "stochastic_rounding": True},
        {"moment_format": "log"},
    ],
)
def test_genuine_states_still_load_and_step_finite(options):
    params, sd = _trained(**options)
    opt = _load(params, sd, **options)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(torch.isfinite(p).all() for p in opt.param_groups[0]["params"])


def test_negative_second_moment_codes_are_refused():
    params, sd = _trained()
    v = sd["state"][0]["exp_avg_sq_fp8"]
    sd["state"][0]["exp_avg_sq_fp8"] = (-(v.float().abs().clamp(min=1))).to(v.dtype)
    assert "negative" in _refused(params, sd, 0, "exp_avg_sq_fp8")


@pytest.mark.parametrize(
    ("options", "code", "key"),
    [
        ({"fp8_format": "e5m2", "dynamic_range_expansion": False}, 0x7C, "exp_avg_fp8"),  # +inf
        ({"fp8_format": "e5m2", "dynamic_range_expansion": False}, 0xFE, "exp_avg_sq_fp8"),
        ({}, 0x7F, "exp_avg_fp8"),  # e4m3fn NaN
        ({}, 0xFF, "exp_avg_sq_fp8"),
    ],
)
def test_non_finite_fp8_codes_are_refused(options, code, key):
    params, sd = _trained(**options)
    codes = sd["state"][0][key]
    codes.view(torch.uint8)[3, 5] = code
    assert not torch.isfinite(codes.float()).all()  # torch itself reads it as inf / NaN
    assert _names(_refused(params, sd, 0, key, **options), 0, key)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("exp_avg", float("nan")),
        ("exp_avg", float("inf")),
        ("exp_avg_sq", float("nan")),
        ("exp_avg_sq", float("-inf")),
    ],
)  # +inf in exp_avg_sq is what torch.optim.AdamW writes after an overflow: accepted
def test_non_finite_fp32_moments_are_refused(key, value):
    params, sd = _trained()
    sd["state"][1][key][3] = value
    assert _names(_refused(params, sd, 1, key), 1, key)


@pytest.mark.parametrize(
    ("options", "key", "code_max"),
    [
        ({}, "exp_avg_scale", torch.finfo(torch.float8_e4m3fn).max),
        ({}, "exp_avg_sq_scale", torch.finfo(torch.float8_e4m3fn).max),
        (
            {"fp8_format": "e5m2", "dynamic_range_expansion": False},
            "exp_avg_scale",
            torch.finfo(torch.float8_e5m2).max,
        ),
        ({"moment_format": "log"}, "exp_avg_scale", 127.0),
    ],
)
def test_scales_whose_largest_code_overflows_are_refused(options, key, code_max):
    """``code_max · scale`` must stay finite in fp32; just below the limit still loads."""
    params, sd = _trained(**options)
    limit = FLT_MAX / code_max
    sd["state"][0][key].fill_(limit * 4)
    assert _names(_refused(params, sd, 0, key, **options), 0, key)
    if key == "exp_avg_sq_scale" or "moment_format" in options:
        return  # below: a huge v / log m also needs matching codes; covered by the decode test
    _, sd = _trained(**options)
    sd["state"][0][key].fill_(limit / 2)
    _load(params, sd, **options)


def test_log_first_moment_overflowing_through_its_power_of_two_is_refused():
    """log: ``m̂ = q·scale·2^e`` with ``2^e ≈ sqrt(v̂)``: a scale below FLT_MAX / 127 still
    overflows when v is large (here 2^e ≈ 3e18, 127·1e20·3e18 > 3.4e38)."""
    params, sd = _trained(moment_format="log")
    st = sd["state"][0]
    st["exp_avg_sq_scale"].fill_(1e37)
    st["exp_avg_scale"].fill_(1e20)
    assert FLT_MAX / 127 > 1e20  # the scale alone is within its cap
    assert _names(_refused(params, sd, 0, "exp_avg_scale", moment_format="log"), 0, "exp_avg_scale")


def test_log_int8_code_outside_the_format_is_refused():
    """The log format's m codes are -127..127; -128 is not a code it writes."""
    params, sd = _trained(moment_format="log")
    sd["state"][0]["exp_avg_fp8"][0, 0] = -128
    assert _names(_refused(params, sd, 0, "exp_avg_fp8", moment_format="log"), 0, "exp_avg_fp8")
