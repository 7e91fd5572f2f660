"""optim="adamw_fp8" with optim_args moment_format=log / auto (reviewer R1 finding 8).

optim="adamw_fp8" sets dynamic_range_expansion=False itself; the log codes always expand,
and "auto" then always resolves to the fp8 codes (accepted, as by the class). The error used to blame that option as if
the user had passed it and suggest moment_format='fp8' / 'auto'; it must name the Trainer
name that gives the log format: optim="adamw_fp8_coat".
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_fp8.optim import AdamWFp8


def _resolve(tmp_path, optim: str, optim_args: str) -> tuple[type, dict]:
    training_args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        optim=optim,
        optim_args=optim_args,
    )
    return Trainer.get_optimizer_cls_and_kwargs(training_args)


@pytest.mark.parametrize("fmt", ["log"])  # "auto" is fp8 there, accepted (R4 finding 5)
def test_plain_fp8_name_with_log_codes_points_to_the_coat_name(tmp_path, fmt):
    with pytest.raises(ValueError) as info:
        cls, kwargs = _resolve(tmp_path, "adamw_fp8", f"moment_format={fmt}")
        cls([torch.nn.Parameter(torch.zeros(64, 128))], **kwargs)
    message = str(info.value)
    assert 'optim="adamw_fp8_coat"' in message
    assert f"moment_format={fmt}" in message
    assert "pass moment_format='fp8'" not in message  # not the option the user never set


@pytest.mark.parametrize(
    ("optim", "optim_args", "code_dtype"),
    [
        ("adamw_fp8_coat", "moment_format=log", torch.int8),
        ("adamw_fp8_coat", "moment_format=auto", torch.int8),
        ("adamw_fp8", "moment_format=fp8", torch.float8_e4m3fn),
        # the user's own dynamic_range_expansion overrides the name's: log is then valid
        ("adamw_fp8", "moment_format=log,dynamic_range_expansion=true", torch.int8),
        ("adamw_fp8", "moment_format=auto,dynamic_range_expansion=false", torch.float8_e4m3fn),
    ],
)
def test_consistent_combinations_still_build(tmp_path, optim, optim_args, code_dtype):
    cls, kwargs = _resolve(tmp_path, optim, optim_args)
    assert cls is AdamWFp8
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = cls([p], **kwargs)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["exp_avg_fp8"].dtype == code_dtype
