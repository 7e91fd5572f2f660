"""Loaded scales are checked by sign and against the codes they scale (reviewer R4 findings 2, 6).

A scale with the sign bit set (-0.0 passes ``>= 0``) and a group whose scale is below the
threshold where quantization writes zeros (``F·scale < FLT_MIN`` for fp8 codes, ``amax <
FLT_MIN`` for the log format's v, ``127·scale < 2^-100`` for its m) but whose codes are not
zero are states the optimizer never writes; both moved or NaN'd weights after one step. The
reference for "never written" is a fresh optimizer's own state (codes of zero groups are 0).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.optim._state_check import OptimizerStateError

FORMATS = [{}, {"dynamic_range_expansion": False}, {"moment_format": "log"}]
SCALES = {
    "fp8": ("exp_avg_scale", "exp_avg_sq_scale"),
    "log": ("exp_avg_scale", "exp_avg_sq_scale"),
}


def _trained(**options) -> tuple[torch.nn.Parameter, dict]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 256))
    opt = AdamWFp8([p], lr=1e-3, min_quantize_numel=0, weight_decay=0.0, **options)
    p.grad = torch.randn_like(p)
    opt.step()
    return p, copy.deepcopy(opt.state_dict())


def _load(p: torch.nn.Parameter, sd: dict, **options) -> AdamWFp8:
    q = torch.nn.Parameter(p.detach().clone())
    opt = AdamWFp8([q], lr=1e-3, min_quantize_numel=0, weight_decay=0.0, **options)
    opt.load_state_dict(sd)
    return opt


def _codes(key: str) -> str:
    return key.replace("_scale", "_fp8")


@pytest.mark.parametrize("options", FORMATS)
@pytest.mark.parametrize("key", ["exp_avg_scale", "exp_avg_sq_scale"])
def test_a_negative_zero_scale_is_refused(options, key) -> None:
    p, sd = _trained(**options)
    sd["state"][0][key][0, 0] = -0.0
    sd["state"][0][_codes(key)][0, :128] = 0  # zero codes: only the sign bit is wrong
    with pytest.raises(OptimizerStateError, match=repr(key)) as info:
        _load(p, sd, **options)
    assert "sign" in str(info.value)


@pytest.mark.parametrize("impl", ["reference", "cpu_kernel"])
def test_negative_zero_log_v_scale_never_reaches_a_step(impl) -> None:
    """R4's repro (f4.py): the state is refused; had it loaded, weights were NaN."""
    p, sd = _trained(moment_format="log")
    sd["state"][0]["exp_avg_sq_scale"][0, 0] = -0.0
    sd["state"][0]["exp_avg_sq_fp8"][0, :128] = 254
    with pytest.raises(OptimizerStateError, match="exp_avg_sq_scale"):
        _load(p, sd, moment_format="log", implementation=impl)


@pytest.mark.parametrize("options", FORMATS)
@pytest.mark.parametrize("key", ["exp_avg_scale", "exp_avg_sq_scale"])
@pytest.mark.parametrize("scale", [0.0, 1e-45])
def test_non_zero_codes_under_a_zero_scale_are_refused(options, key, scale) -> None:
    p, sd = _trained(**options)
    st = sd["state"][0]
    st[key][0, 0] = scale
    assert bool((st[_codes(key)][0, :128].view(torch.uint8) & 0x7F).any())  # codes kept
    with pytest.raises(OptimizerStateError, match=repr(key)):
        _load(p, sd, **options)


@pytest.mark.parametrize("options", FORMATS)
def test_zero_groups_written_by_the_optimizer_load(options) -> None:
    """The optimizer's own zero groups (zero gradient rows) pass: codes 0 with scale 0."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 256))
    opt = AdamWFp8([p], min_quantize_numel=0, **options)
    p.grad = torch.randn_like(p)
    p.grad[0] = 0.0
    p.grad[1, :128] = 1e-30  # m, v below the thresholds
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert float(sd["state"][0]["exp_avg_sq_scale"][0, 0]) == 0.0
    loaded = _load(p, sd, **options)
    m, v = loaded.moments(loaded.param_groups[0]["params"][0])
    m0, v0 = opt.moments(p)
    assert torch.equal(m, m0) and torch.equal(v, v0)


def test_f4c_zero_scale_does_not_move_weights() -> None:
    """R4 f4c.py: before, a zero-gradient step moved a weight by ~4.7e5 (lr 1e-3)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 256))
    p.grad = torch.randn_like(p) * 1e-6
    opt = AdamWFp8([p], min_quantize_numel=0, implementation="reference", weight_decay=0.0)
    opt.step()
    st = copy.deepcopy(opt.state_dict())
    st["state"][0]["exp_avg_scale"][0, 0] = 0.0
    st["state"][0]["exp_avg_sq_scale"][0, 0] = 0.0
    st["state"][0]["exp_avg_sq_fp8"][0, :128] = 0
    with pytest.raises(OptimizerStateError, match="exp_avg_scale"):
        _load(p, st, implementation="reference")
