"""Review 24 finding 5: the codes past a parameter's last column (the padding of its last
group) are zero in every state the optimizer writes. A loaded state with non-zero padding
codes passed validation, and then the reference step decoded them into the group's
statistics while the C kernel ignored them: the two implementations diverged silently.
Such a state is now refused on load, naming the parameter, the tensor and the fix."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_fp8.optim import AdamWFp8
from hf_fp8.optim._state_check import OptimizerStateError

COLS, GS = 136, 128  # 2 groups per row, the second holds 8 real columns and 120 padding


def _saved(fmt: str, fp8_format: str = "e4m3") -> dict:
    p = torch.nn.Parameter(torch.randn(4, COLS, generator=torch.Generator().manual_seed(0)))
    opt = AdamWFp8(
        [p],
        lr=1e-2,
        min_quantize_numel=1,
        group_size=GS,
        implementation="reference",
        moment_format=fmt,
        fp8_format=fp8_format,
    )
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    opt.step()
    return opt.state_dict()


def _fresh(fmt: str, fp8_format: str = "e4m3") -> AdamWFp8:
    p = torch.nn.Parameter(torch.zeros(4, COLS))
    return AdamWFp8(
        [p],
        lr=1e-2,
        min_quantize_numel=1,
        group_size=GS,
        implementation="reference",
        moment_format=fmt,
        fp8_format=fp8_format,
    )


@pytest.mark.parametrize("fmt", ["fp8", "log"])
def test_written_state_has_zero_padding_and_reloads(fmt):
    sd = _saved(fmt)
    for key in ("exp_avg_fp8", "exp_avg_sq_fp8"):
        codes = sd["state"][0][key]
        assert codes.shape == (4, 2 * GS)
        assert bool((codes[:, COLS:].view(torch.uint8) == 0).all()), key
    opt = _fresh(fmt)
    opt.load_state_dict(copy.deepcopy(sd))  # a state the optimizer wrote is accepted
    p = opt.param_groups[0]["params"][0]
    assert torch.equal(opt.state[p]["exp_avg_fp8"], sd["state"][0]["exp_avg_fp8"])


@pytest.mark.parametrize(("fmt", "fp8_format"), [("fp8", "e4m3"), ("fp8", "e5m2"), ("log", "e4m3")])
@pytest.mark.parametrize("key", ["exp_avg_fp8", "exp_avg_sq_fp8"])
@pytest.mark.parametrize("column", [COLS, 2 * GS - 1])
def test_nonzero_padding_codes_are_refused(fmt, fp8_format, key, column):
    sd = _saved(fmt, fp8_format)
    sd["state"][0][key].view(torch.uint8)[2, column] = 0x01  # smallest non-zero code
    opt = _fresh(fmt, fp8_format)
    p = opt.param_groups[0]["params"][0]
    with pytest.raises(OptimizerStateError) as info:
        opt.load_state_dict(sd)
    msg = str(info.value)
    assert "parameter 0" in msg and repr(key) in msg
    assert "padding" in msg and f"{COLS}" in msg
    assert "drop this parameter's entry" in msg  # the fix
    assert opt.state[p] == {}  # nothing installed


def test_negative_zero_padding_is_a_zero_code():
    """fp8 -0 (0x80) decodes to zero, as in the rest of the checks: it is accepted."""
    sd = _saved("fp8")
    sd["state"][0]["exp_avg_fp8"].view(torch.uint8)[:, COLS:] = 0x80
    opt = _fresh("fp8")
    opt.load_state_dict(sd)
    loaded = next(iter(opt.state.values()))["exp_avg_fp8"].view(torch.uint8)
    assert torch.equal(loaded, sd["state"][0]["exp_avg_fp8"].view(torch.uint8))


@pytest.mark.filterwarnings("ignore:AdamWFp8. converted")
@pytest.mark.parametrize("implementation", ["reference", "cpu_kernel"])
@pytest.mark.parametrize(
    "options",
    [
        {"moment_format": "fp8", "stochastic_rounding": True},
        {"moment_format": "fp8", "dynamic_range_expansion": False},
        {"moment_format": "fp8", "sqrt_second_moment": True, "fp8_format": "e5m2"},
        {"moment_format": "log"},
    ],
)
def test_states_written_by_steps_and_conversion_reload(implementation, options):
    """Every state the optimizer writes (several steps, each option; a converted
    ``torch.optim.AdamW`` state) has zero padding and passes the new check."""
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4, COLS, generator=gen))
    kw = dict(lr=1e-2, min_quantize_numel=1, group_size=GS, **options)
    opt = AdamWFp8([p], implementation=implementation, **kw)
    ref = torch.optim.AdamW([q := torch.nn.Parameter(p.detach().clone())], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for source in (opt.state_dict(), ref.state_dict()):
        fresh = AdamWFp8([torch.nn.Parameter(torch.zeros(4, COLS))], **kw)
        fresh.load_state_dict(copy.deepcopy(source))
        (st,) = fresh.state.values()
        for key in ("exp_avg_fp8", "exp_avg_sq_fp8"):
            pad = st[key][:, COLS:]
            b = pad.view(torch.uint8) & (0x7F if pad.is_floating_point() else 0xFF)
            assert bool((b == 0).all()), key


def test_padding_check_ignores_aligned_rows():
    """With whole groups per row there is no padding: random (finite, valid) codes load."""
    p = torch.nn.Parameter(torch.randn(4, 2 * GS))
    opt = AdamWFp8([p], lr=1e-2, min_quantize_numel=1, group_size=GS, moment_format="fp8")
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    opt2 = AdamWFp8([p], lr=1e-2, min_quantize_numel=1, group_size=GS, moment_format="fp8")
    opt2.load_state_dict(sd)
    for key in ("exp_avg_fp8", "exp_avg_sq_fp8"):
        loaded = opt2.state[p][key].view(torch.uint8)
        assert torch.equal(loaded, sd["state"][0][key].view(torch.uint8)), key
