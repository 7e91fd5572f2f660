"""Review 26 finding 2: a loaded state whose parameter groups do not match this optimizer's
(another set of trainable parameters, other weight-decay groups) was refused with a message
that named no fix. It still raises ValueError, as ``torch.optim.AdamW`` does for the same
state, and now says what to do: build the optimizer over the checkpoint's parameters and
groups, or resume without ``optimizer.pt`` (and what transformers' Trainer then does)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hf_fp8.optim import AdamWFp8

FIX_WORDS = ("same trainable parameters", "optimizer.pt", "restart")


def _params(n: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 8)) for _ in range(n)]


def _saved(groups: list[int]) -> dict:
    opt = AdamWFp8([{"params": _params(n)} for n in groups], lr=1e-2)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt.state_dict()


def _torch_error(saved_groups: list[int], groups: list[int]) -> type[BaseException]:
    """The exception ``torch.optim.AdamW`` raises for the same mismatch (the reference)."""
    src = torch.optim.AdamW([{"params": _params(n)} for n in saved_groups])
    dst = torch.optim.AdamW([{"params": _params(n)} for n in groups])
    with pytest.raises(Exception) as info:
        dst.load_state_dict(src.state_dict())
    return info.type


@pytest.mark.parametrize(
    ("saved_groups", "groups", "counts"),
    [
        ([16], [9], ("16 parameters", "9")),  # other trainable parameters (R26's case)
        ([3, 2], [5], ("2 parameter groups", "1")),  # other weight-decay grouping
    ],
)
def test_group_mismatch_names_the_fix(saved_groups, groups, counts):
    want = _torch_error(saved_groups, groups)
    assert want is ValueError
    opt = AdamWFp8([{"params": _params(n)} for n in groups], lr=1e-2)
    with pytest.raises(want) as info:
        opt.load_state_dict(_saved(saved_groups))
    msg = str(info.value)
    for word in counts + FIX_WORDS:
        assert word in msg, (word, msg)
    assert all(not st for st in opt.state.values())  # nothing installed


class _Tiny(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ws = nn.ParameterList(_params(n))

    def forward(self, x):  # pragma: no cover - never trained here
        return x


def test_trainer_resume_follows_the_message(tmp_path):
    """The message's Trainer advice, checked against plain transformers: a mismatched
    optimizer.pt fails the resume with the fix; with optimizer.pt moved away the Trainer
    loads neither optimizer nor scheduler state (moments and LR schedule restart)."""
    from transformers import Trainer, TrainingArguments

    model = _Tiny(9)
    opt = AdamWFp8(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, optimizers=(opt, sched))
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    saved_sched = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.AdamW(_params(1)), lambda s: 1.0 / (1 + s)
    )
    for _ in range(5):
        saved_sched.step()
    torch.save(_saved([16]), ckpt / "optimizer.pt")
    torch.save(saved_sched.state_dict(), ckpt / "scheduler.pt")

    with pytest.raises(ValueError, match=r"optimizer\.pt out of the checkpoint folder"):
        trainer._load_optimizer_and_scheduler(str(ckpt))
    (ckpt / "optimizer.pt").rename(tmp_path / "optimizer.pt")
    trainer._load_optimizer_and_scheduler(str(ckpt))
    assert all(not st for st in opt.state.values())  # the moments restart
    assert sched.last_epoch == 0  # scheduler.pt was not loaded: the schedule restarts
