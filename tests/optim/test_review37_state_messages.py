"""Errors for foreign, damaged or other-format optimizer states (reviewer R37 findings 1, 4, 5).

A Trainer resume feeds ``optimizer.pt`` to ``AdamWFp8.load_state_dict``. Before: an Adafactor
state or a group value that is not a number (``lr=None``, ``betas=0.9``, ``eps='1e-8'``)
escaped as a raw ``TypeError``; a state dict without ``state`` / ``param_groups`` /
``params`` as a raw ``KeyError`` / ``AttributeError``; ``group_size='128'`` said "create the
optimizer with group_size='128'"; fp8 codes retyped as uint8 were read as the log format the
saved group does not name; a state of another format named only the constructor argument, and
a state that does not fit its parameter only "drop this parameter's entry from
state_dict['state']" — nothing a Trainer user can do. Every error must be a ``ValueError`` that
names the group / entry and a fix a Trainer user can apply (moving ``optimizer.pt`` aside).

The reference for "refused" is ``torch.optim.AdamW``: it cannot run from these states either
(it fails at its first step), so refusing them at load is the same verdict, earlier.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.optimization import Adafactor

from hf_fp8.optim import AdamWFp8, OptimizerStateError

RESTART = "move optimizer.pt out of the checkpoint folder"


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(128, 64)  # weight [64, 128]: quantized; bias: fp32 state


def _step(opt: torch.optim.Optimizer, lin: torch.nn.Linear) -> None:
    lin.zero_grad()
    lin(torch.randn(4, 128)).square().sum().backward()
    opt.step()


def _saved(**options) -> dict:
    lin = _linear()
    opt = AdamWFp8(lin.parameters(), lr=1e-3, **options)
    _step(opt, lin)
    return copy.deepcopy(opt.state_dict())


def _torch_adamw_refuses(state: dict) -> bool:
    """Whether torch.optim.AdamW fails to load or to step from ``state`` (the reference)."""
    lin = _linear()
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    try:
        opt.load_state_dict(copy.deepcopy(state))
        _step(opt, lin)
    except Exception:
        return True
    return False


def _load_error(state: dict, **options) -> str:
    opt = AdamWFp8(_linear().parameters(), lr=1e-3, **options)
    with pytest.raises(ValueError) as info:  # never a TypeError / KeyError / AttributeError
        opt.load_state_dict(copy.deepcopy(state))
    return str(info.value)


def test_an_adafactor_state_is_named_another_optimizers():
    lin = _linear()
    ada = Adafactor(lin.parameters(), lr=1e-3, scale_parameter=False, relative_step=False)
    _step(ada, lin)
    state = ada.state_dict()
    assert isinstance(state["param_groups"][0]["eps"], tuple)  # (1e-30, 1e-3): not a number
    assert _torch_adamw_refuses(state)
    message = _load_error(state)
    assert "loaded param group 0" in message
    assert "another optimizer" in message
    assert RESTART in message


def test_an_sgd_state_is_named_another_optimizers():
    lin = _linear()
    sgd = torch.optim.SGD(lin.parameters(), lr=1e-2, momentum=0.9)
    _step(sgd, lin)
    state = sgd.state_dict()
    assert _torch_adamw_refuses(state)
    message = _load_error(state)
    assert "loaded param group 0" in message and "another optimizer" in message
    assert RESTART in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lr", None),
        ("lr", "1e-3"),
        ("betas", 0.9),
        ("betas", (0.9, "0.999")),
        ("eps", "1e-8"),
        ("eps", (1e-30, 1e-3)),
        ("weight_decay", None),
    ],
)
def test_a_group_value_of_the_wrong_type_names_the_group_and_the_fix(key, value):
    state = _saved()
    state["param_groups"][0][key] = value
    message = _load_error(state)
    assert message.startswith("loaded param group 0: ")
    assert key in message and repr(value) in message
    assert RESTART in message


@pytest.mark.parametrize("key", ["state", "param_groups"])
def test_a_state_dict_without_its_entries_names_the_entry(key):
    state = _saved()
    del state[key]
    message = _load_error(state)
    assert repr(key) in message and "optimizer.pt" in message and RESTART in message


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda s: s["param_groups"][0].pop("params"), "'params'"),
        (lambda s: s.update(state=list(s["state"].values())), "'state' is a list"),
        (lambda s: s.update(param_groups={0: s["param_groups"][0]}), "param_groups is a dict"),
        (lambda s: s["param_groups"].__setitem__(0, None), "param group 0 is a NoneType"),
    ],
)
def test_a_state_dict_of_the_wrong_structure_names_the_entry(damage, words):
    state = _saved()
    damage(state)
    message = _load_error(state)
    assert words in message and RESTART in message


def test_a_damaged_format_option_is_not_offered_as_the_fix():
    state = _saved()
    state["param_groups"][0]["group_size"] = "128"
    message = _load_error(state)
    assert message.startswith("loaded param group 0: group_size must be an int")
    assert "create the optimizer with group_size='128'" not in message
    assert RESTART in message


def test_retyped_codes_are_reported_against_the_saved_group():
    state = _saved()
    assert state["param_groups"][0]["moment_format"] == "fp8"
    state["state"][0]["exp_avg_fp8"] = state["state"][0]["exp_avg_fp8"].view(torch.uint8)
    opt = AdamWFp8(_linear().parameters(), lr=1e-3)
    with pytest.raises(OptimizerStateError) as info:
        opt.load_state_dict(state)
    message = str(info.value)
    assert "state['exp_avg_fp8']" in message and "torch.uint8" in message
    assert "moment_format='fp8'" in message  # what the saved group says
    assert "create the optimizer with moment_format='log'" not in message
    assert RESTART in message


def test_a_state_that_does_not_fit_its_parameter_gives_the_trainer_fix():
    state = _saved()
    state["state"][0]["exp_avg_scale"] = state["state"][0]["exp_avg_scale"][:32].clone()
    opt = AdamWFp8(_linear().parameters(), lr=1e-3)
    with pytest.raises(OptimizerStateError) as info:
        opt.load_state_dict(state)
    message = str(info.value)
    assert "drop this parameter's entry" in message  # the plain-torch fix stays
    assert RESTART in message and "scheduler.pt" in message


@pytest.mark.parametrize(
    ("saved", "loading", "trainer_words"),
    [
        ({}, {"dynamic_range_expansion": False}, 'optim="adamw_fp8_coat"'),
        ({"dynamic_range_expansion": False}, {}, 'optim="adamw_fp8"'),
        ({}, {"moment_format": "log"}, 'optim="adamw_fp8_coat", optim_args="moment_format=fp8"'),
        ({}, {"group_size": 64}, 'optim="adamw_fp8_coat", optim_args="group_size=128"'),
        (
            {"moment_format": "log"},
            {"dynamic_range_expansion": False},
            'optim="adamw_fp8_coat", optim_args="moment_format=log"',  # both differences at once
        ),
    ],
)
def test_another_format_names_the_trainer_route_the_conversion_and_the_restart(
    saved, loading, trainer_words
):
    message = _load_error(_saved(**saved), **loading)
    assert message.startswith("cannot load an AdamWFp8 state saved with ")
    assert trainer_words in message
    assert "torch_state_dict()" in message
    assert RESTART in message


def test_the_conversion_the_message_names_works():
    """The route the format error names: the saving optimizer's torch_state_dict() loads into
    an optimizer of the other format, whose moments then match the saved ones to within the
    8-bit codes (reference: the fp32 moments torch_state_dict() decoded)."""
    lin = _linear()
    saver = AdamWFp8(lin.parameters(), lr=1e-3)  # fp8 codes, group_size 128
    _step(saver, lin)
    fp32 = saver.torch_state_dict()
    other = AdamWFp8(lin.parameters(), lr=1e-3, group_size=64)
    with pytest.raises(ValueError) as info:
        other.load_state_dict(saver.state_dict())
    assert "torch_state_dict()" in str(info.value)
    other.load_state_dict(fp32)
    m, v = other.moments(lin.weight)
    ref_m, ref_v = fp32["state"][0]["exp_avg"], fp32["state"][0]["exp_avg_sq"]
    assert torch.allclose(m, ref_m, rtol=0.15, atol=0.15 * ref_m.abs().max().item())
    assert torch.allclose(v, ref_v, rtol=0.15, atol=0.15 * ref_v.abs().max().item())
