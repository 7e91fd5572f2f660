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

NEEDS_DIFF = pytest.mark.xfail(
    reason="needs /work/notes/diffs/hf35-optim-messages.diff", strict=True
)


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


@NEEDS_DIFF
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


@NEEDS_DIFF
def test_an_explicit_option_in_a_param_group_counts_too():
    params = _params()
    opt = AdamWFp8([{"params": params[:1], "seed": 3}, {"params": params[1:]}], lr=1e-3)
    saver = AdamWFp8([{"params": _params()[:1]}, {"params": _params()[1:]}], lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saver.state_dict())
    messages = [str(w.message) for w in caught if "seed" in str(w.message)]
    assert len(messages) == 1 and "param group 0 has seed=0 (you set 3)" in messages[0]
    assert "param group 1" not in messages[0]


@NEEDS_DIFF
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
