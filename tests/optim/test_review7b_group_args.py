"""Group hyper-parameters given as tensors (reviewer R4 findings 3, 4) and the Trainer's
``optim_args="moment_format=auto"`` (finding 5). References: ``torch.optim.AdamW`` (it takes
0-d tensor betas and refuses a NaN / negative tensor lr) and an optimizer given floats."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_fp8.optim import AdamWFp8


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 256)), torch.nn.Parameter(torch.randn(64))]


def _grads(params) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn_like(p) for p in params]


def _run(opt: torch.optim.Optimizer, params, grads) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("impl", ["reference", "cpu_kernel"])
@pytest.mark.parametrize("route", ["constructor", "torch_state"])
def test_tensor_betas_step_as_floats(impl, route) -> None:
    betas_t = (torch.tensor(0.9), torch.tensor(0.999))
    twin = _params()
    # the twin takes the betas' values as floats (fp32 tensors: 0.9 is 0.8999999761581421)
    reference = AdamWFp8(twin, betas=tuple(float(b) for b in betas_t), implementation=impl)
    ps = _params()
    if route == "constructor":
        opt = AdamWFp8(ps, betas=betas_t, implementation=impl)
    else:  # a torch.optim.AdamW state with tensor betas (torch accepts them)
        src = _params()
        torch_opt = torch.optim.AdamW(src, betas=betas_t)
        _run(torch_opt, src, _grads(src))
        sd = copy.deepcopy(torch_opt.state_dict())
        for st in sd["state"].values():  # same starting moments as the twin: none
            st.clear()
        opt = AdamWFp8(ps, implementation=impl)
        opt.load_state_dict(sd)
        reference.param_groups[0]["weight_decay"] = opt.param_groups[0]["weight_decay"]
    grads = _grads(ps)
    _run(opt, ps, grads)
    _run(reference, twin, grads)
    for a, b in zip(ps, twin, strict=True):
        assert torch.equal(a.detach(), b.detach())
    # the bias keeps fp32 states: torch.optim.AdamW with the same tensor betas is the reference
    bias = torch.nn.Parameter(_params()[1].detach().clone())
    torch_opt = torch.optim.AdamW([bias], betas=betas_t, weight_decay=opt.defaults["weight_decay"])
    _run(torch_opt, [bias], [grads[1]])
    torch.testing.assert_close(ps[1].detach(), bias.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("betas", [(torch.tensor([0.9, 0.8]), 0.999), (torch.tensor(1.5), 0.9)])
def test_bad_tensor_betas_are_refused_up_front(betas) -> None:
    with pytest.raises(ValueError, match="betas"):
        AdamWFp8(_params(), betas=betas)


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_bad_tensor_lr_is_refused_like_torch(bad) -> None:
    with pytest.raises(ValueError, match="Invalid learning rate"):
        torch.optim.AdamW(_params(), lr=torch.tensor(bad))
    with pytest.raises(ValueError, match="learning rate"):
        AdamWFp8(_params(), lr=torch.tensor(bad))
    opt = AdamWFp8(_params())
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(bad)
    with pytest.raises(ValueError, match="learning rate"):
        opt.load_state_dict(sd)


def test_trainer_plain_fp8_with_moment_format_auto_is_fp8(tmp_path) -> None:
    """auto means fp8 codes when expansion is off: the direct class call accepts it."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    import hf_fp8  # noqa: F401  (registers the Trainer names)

    args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        optim="adamw_fp8",
        optim_args="moment_format=auto",
    )
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert kwargs["moment_format"] == "auto" and kwargs["dynamic_range_expansion"] is False
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = cls([p], **{k: v for k, v in kwargs.items() if k != "lr"})
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["exp_avg_fp8"].dtype == torch.float8_e4m3fn
    args.optim_args = "moment_format=log"
    with pytest.raises(ValueError, match="adamw_fp8_coat"):
        Trainer.get_optimizer_cls_and_kwargs(args)
