"""optim_args strings through the stock Trainer (reviewer R37 finding 3).

transformers parses ``optim_args`` into a dict, so ``group_size=64,group_size=32`` reached the
handler as ``{"group_size": "32"}``: the first value was dropped silently. A mistyped
``stochastic_rounding`` value said "expected a boolean (true/false)", hiding the accepted
``exp_avg_sq``, and upper case was refused there though the booleans take it. An unknown key
under ``optim="adamw_fp8_coat"`` was reported "for adamw_fp8".
"""

from __future__ import annotations

import pytest
from transformers import Trainer, TrainingArguments
from transformers.trainer_optimizer import _parse_optim_args

from hf_fp8.optim import AdamWFp8


def _resolve(tmp_path, optim: str, optim_args: str) -> dict:
    training_args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, optim=optim, optim_args=optim_args
    )
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    assert cls is AdamWFp8
    return kwargs


@pytest.mark.parametrize(
    ("optim_args", "key"),
    [
        ("group_size=64,group_size=32", "group_size"),
        ("seed=1,seed=2", "seed"),
        ("seed=1, stochastic_rounding=false, seed=1", "seed"),  # the same value twice too
    ],
)
def test_a_duplicated_key_is_refused_naming_it(tmp_path, optim_args, key):
    # transformers' own parser keeps only the last value: the handler sees no duplicate
    assert list(_parse_optim_args(optim_args)).count(key) == 1
    with pytest.raises(ValueError) as info:
        _resolve(tmp_path, "adamw_fp8_coat", optim_args)
    message = str(info.value)
    assert f"{key!r}" in message and "more than once" in message
    assert "adamw_fp8_coat" in message  # the optim used


@pytest.mark.parametrize("value", ["exp_avg", "v", "2"])
def test_a_wrong_rounding_value_lists_every_accepted_value(tmp_path, value):
    with pytest.raises(ValueError) as info:
        _resolve(tmp_path, "adamw_fp8_coat", f"stochastic_rounding={value}")
    message = str(info.value)
    for accepted in ("exp_avg_sq", "true", "false"):
        assert accepted in message, (accepted, message)
    assert repr(value) in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("EXP_AVG_SQ", "exp_avg_sq"), ("Exp_Avg_Sq", "exp_avg_sq"), ("TRUE", True), ("False", False)],
)
def test_rounding_values_are_case_insensitive_as_the_booleans(tmp_path, value, expected):
    # the booleans already took any case (as transformers' strtobool for its own optim_args)
    kwargs = _resolve(tmp_path, "adamw_fp8_coat", f"stochastic_rounding={value}")
    assert kwargs["stochastic_rounding"] == expected
    assert type(kwargs["stochastic_rounding"]) is type(expected)


@pytest.mark.parametrize("optim", ["adamw_fp8_coat", "adamw_fp8"])
def test_an_unknown_key_names_the_optim_used(tmp_path, optim):
    with pytest.raises(ValueError) as info:
        _resolve(tmp_path, optim, "block_size=64")
    message = str(info.value)
    assert "unknown optim_args key 'block_size'" in message
    assert f'optim="{optim}"' in message
