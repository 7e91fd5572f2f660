"""state_dict / load_state_dict: exact resume, safe loading, format mismatches."""

from __future__ import annotations

import io

import pytest
import torch

from hf_fp8.optim import AdamWFp8

SHAPES = [(64, 256), (40, 200), (256,), (8, 8)]


def make(dtype=torch.float32, **kwargs) -> tuple[list[torch.nn.Parameter], AdamWFp8]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in SHAPES]
    groups = [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "weight_decay": 0.0, "lr": 3e-3},
    ]
    return params, AdamWFp8(groups, lr=1e-2, **kwargs)


def train(params, opt, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
        opt.step()


def roundtrip(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


FORMATS = {  # options -> dtype of the stored exp_avg codes
    "log": ({"moment_format": "log"}, torch.int8),
    "fp8_coat": ({}, torch.float8_e4m3fn),
    "fp8_plain": ({"dynamic_range_expansion": False}, torch.float8_e4m3fn),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_save_load_resume_is_bit_identical(dtype, fmt):
    options, codes = FORMATS[fmt]
    params, opt = make(dtype, **options)
    train(params, opt, range(3))
    saved_opt = roundtrip(opt.state_dict())
    saved_params = [p.detach().clone() for p in params]
    train(params, opt, range(3, 6))

    params2, opt2 = make(dtype, **options)
    with torch.no_grad():
        for p, saved in zip(params2, saved_params, strict=True):
            p.copy_(saved)
    opt2.load_state_dict(saved_opt)
    state = opt2.state[params2[0]]
    assert state["exp_avg_fp8"].dtype == codes
    assert state["exp_avg_scale"].dtype == torch.float32  # not cast to the param dtype
    assert opt2.state[params2[2]]["exp_avg"].dtype == torch.float32
    train(params2, opt2, range(3, 6))
    for a, b in zip(params, params2, strict=True):
        assert torch.equal(a, b)


def test_state_dict_is_plain_tensors_and_records_format():
    params, opt = make()
    train(params, opt, range(1))
    sd = roundtrip(opt.state_dict())  # weights_only=True: no custom classes
    assert sd["param_groups"][0]["group_size"] == 128
    assert sd["param_groups"][0]["fp8_format"] == "e4m3"
    kinds = {type(v) for st in sd["state"].values() for v in st.values()}
    assert kinds == {torch.Tensor}


@pytest.mark.parametrize(
    ("saved", "loading", "option"),
    [
        ({"group_size": 64}, {}, "group_size"),
        ({"fp8_format": "e5m2"}, {}, "fp8_format"),
        ({"dynamic_range_expansion": False}, {}, "dynamic_range_expansion"),
        ({"moment_format": "log"}, {}, "moment_format"),
        ({}, {"moment_format": "log"}, "moment_format"),
    ],
)
def test_loading_another_format_raises(saved, loading, option):
    params, opt = make(**saved)
    train(params, opt, range(1))
    _, other = make(**loading)
    with pytest.raises(ValueError, match=f"saved with {option}="):
        other.load_state_dict(roundtrip(opt.state_dict()))


def test_loading_into_different_group_count_raises():
    params, opt = make()
    train(params, opt, range(1))
    other = AdamWFp8(make()[0])
    with pytest.raises(ValueError, match="parameter groups"):
        other.load_state_dict(opt.state_dict())


def test_tampered_state_is_detected():
    params, opt = make(moment_format="fp8")
    train(params, opt, range(1))
    sd = roundtrip(opt.state_dict())
    first = next(iter(sd["state"].values()))
    first["exp_avg_fp8"] = first["exp_avg_fp8"].view(torch.uint8).view(torch.float8_e5m2)
    _, other = make(moment_format="fp8")
    with pytest.raises(ValueError, match="fp8_format"):
        other.load_state_dict(sd)


@pytest.mark.parametrize(
    ("key", "tamper", "message"),
    [
        ("exp_avg_sq_fp8", lambda t: t.view(torch.int8), "dtype torch.int8"),
        ("exp_avg_fp8", lambda t: t.view(torch.uint8), "dtype torch.uint8"),
        ("exp_avg_fp8", lambda t: t.view(torch.float8_e4m3fn), "moment_format='fp8'"),
        ("exp_avg_sq_exponent", lambda t: t * 0, "outside"),
        ("exp_avg_scale", lambda t: -t - 1, "outside"),
        ("exp_avg_exponent", lambda t: torch.ones(2), "moment_format='fp8'"),
        ("exp_avg_sq_fp8", lambda t: t[:, :-1], "shape"),
    ],
)
def test_tampered_log_state_is_refused(key, tamper, message):
    """moment_format="log": exactly int8 m codes, uint8 v codes, finite scales >= 0 and
    exponents in [1/16, 1024] of the parameter's shape are accepted."""
    params, opt = make(moment_format="log")
    train(params, opt, range(1))
    sd = roundtrip(opt.state_dict())
    first = next(iter(sd["state"].values()))
    first[key] = tamper(first.get(key, first["exp_avg_scale"]))
    _, other = make(moment_format="log")
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(sd)
    assert not other.state  # nothing installed
