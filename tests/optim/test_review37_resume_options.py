"""A loaded state replaces options the user set (reviewer R37 finding 2).

``torch.optim`` keeps a loaded state's hyper-parameters (``lr``, ``betas``, ``weight_decay``)
over the ones the optimizer was created with, and so does ``AdamWFp8`` for its own
non-format options (``stochastic_rounding``, ``seed``, ``min_quantize_numel``). That stays,
but a resumed run that asked for ``min_quantize_numel=4096`` and silently got the
checkpoint's ``100000`` keeps fp32 states (8 bytes/parameter): warn once, naming the options,
when a loaded group replaces a value the user set explicitly — and only then.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_fp8.optim import AdamWFp8


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(64))]


def _saved(**options) -> dict:
    params = _params()
    opt = AdamWFp8(params, lr=1e-3, **options)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return copy.deepcopy(opt.state_dict())


def _load(state: dict, **options) -> tuple[AdamWFp8, list[str]]:
    opt = AdamWFp8(_params(), lr=1e-3, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(copy.deepcopy(state))
    return opt, [str(w.message) for w in caught]


def test_torch_keeps_the_loaded_hyper_parameters():
    """The reference: torch.optim.AdamW takes the loaded lr / weight_decay, silently."""
    params = _params()
    saver = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    loader = torch.optim.AdamW(_params(), lr=0.5, weight_decay=0.5)
    loader.load_state_dict(saver.state_dict())
    assert loader.param_groups[0]["lr"] == 1e-3
    assert loader.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("saved", "mine"),
    [
        ({"min_quantize_numel": 100000}, {"min_quantize_numel": 4096}),  # 4096: the default value
        ({"seed": 7}, {"seed": 0}),
        ({}, {"stochastic_rounding": False}),
        ({"stochastic_rounding": True}, {"stochastic_rounding": "exp_avg_sq"}),
    ],
)
def test_a_replaced_explicit_option_warns_naming_it(saved, mine):
    opt, messages = _load(_saved(**saved), **mine)
    ((name, value),) = mine.items()
    kept = saved.get(name, {"seed": 0, "stochastic_rounding": "exp_avg_sq"}.get(name))
    assert opt.param_groups[0][name] == kept  # the checkpoint's value, as torch
    hits = [m for m in messages if name in m]
    assert len(hits) == 1, messages
    assert f"{name}={kept!r}" in hits[0] and f"you set {value!r}" in hits[0]


def test_an_explicit_option_in_a_param_group_counts_too():
    params = _params()
    opt = AdamWFp8([{"params": params[:1], "seed": 3}, {"params": params[1:]}], lr=1e-3)
    saver = AdamWFp8([{"params": _params()[:1]}, {"params": _params()[1:]}], lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saver.state_dict())
    messages = [str(w.message) for w in caught if "seed" in str(w.message)]
    assert len(messages) == 1 and "seed=0 (you set 3) in param group 0." in messages[0]
    assert "param group 1" not in messages[0]


def test_the_warning_survives_accelerates_own_round_trip():
    """accelerate's AcceleratedOptimizer loads the optimizer's own state_dict() (device
    placement) before the Trainer loads optimizer.pt: that first load changes nothing the user
    set and must not make the real one silent."""
    opt = AdamWFp8(_params(), lr=1e-3, min_quantize_numel=4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(opt.state_dict())  # accelerate's round trip
    assert not [w for w in caught if "min_quantize_numel" in str(w.message)]
    with pytest.warns(RuntimeWarning, match=r"min_quantize_numel=100000 \(you set 4096\)"):
        opt.load_state_dict(_saved(min_quantize_numel=100000))
    assert opt.param_groups[0]["min_quantize_numel"] == 100000  # the checkpoint's, as torch


def test_trainer_optim_args_count_as_set(tmp_path):
    training_args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        optim="adamw_fp8_coat",
        optim_args="min_quantize_numel=4096",
    )
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    opt = cls(_params(), **kwargs)
    with pytest.warns(RuntimeWarning, match=r"min_quantize_numel=100000 \(you set 4096\)"):
        opt.load_state_dict(_saved(min_quantize_numel=100000))


@pytest.mark.parametrize(
    ("saved", "mine"),
    [
        ({"min_quantize_numel": 100000, "seed": 7, "stochastic_rounding": False}, {}),  # defaults
        ({"seed": 7}, {"seed": 7}),  # set, to the same value
        ({}, {"min_quantize_numel": 4096, "seed": 0, "stochastic_rounding": "exp_avg_sq"}),
    ],
)
def test_no_warning_when_nothing_the_user_set_is_replaced(saved, mine):
    opt, messages = _load(_saved(**saved), **mine)
    assert not [m for m in messages if "replace" in m], messages
    for name, value in saved.items():
        assert opt.param_groups[0][name] == value


def test_defaults_stay_plain_values():
    """The defaults are stored as plain int / str: state_dict() loads with weights_only."""
    opt = AdamWFp8(_params())
    for name, value in (
        ("seed", 0),
        ("min_quantize_numel", 4096),
        ("stochastic_rounding", "exp_avg_sq"),
    ):
        assert opt.defaults[name] == value and type(opt.defaults[name]) is type(value)
        assert type(opt.param_groups[0][name]) is type(value)
    buffer = __import__("io").BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)
    pickle.loads(pickle.dumps(opt))


def test_the_route_the_warning_names_stores_the_moments_by_the_new_option():
    """min_quantize_numel=100000 kept the [64, 128] weight's moments in fp32; its
    torch_state_dict() loaded into an optimizer with min_quantize_numel=4096 stores them in
    8 bits, decoding to the saved fp32 moments within the codes' resolution."""
    params = _params()
    saver = AdamWFp8(params, lr=1e-3, min_quantize_numel=100000)
    for p in params:
        p.grad = torch.randn_like(p)
    saver.step()
    assert saver.state[params[0]]["exp_avg"].dtype == torch.float32  # fp32: 8 B/param
    fp32 = saver.torch_state_dict()
    opt = AdamWFp8(params, lr=1e-3, min_quantize_numel=4096)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        opt.load_state_dict(fp32)
    assert opt.state[params[0]]["exp_avg_fp8"].dtype == torch.float8_e4m3fn
    m, v = opt.moments(params[0])
    ref_m, ref_v = fp32["state"][0]["exp_avg"], fp32["state"][0]["exp_avg_sq"]
    assert torch.allclose(m, ref_m, rtol=0.15, atol=0.15 * ref_m.abs().max().item())
    assert torch.allclose(v, ref_v, rtol=0.15, atol=0.15 * ref_v.abs().max().item())
    assert opt.param_groups[0]["min_quantize_numel"] == 4096  # torch_state_dict has no own options
