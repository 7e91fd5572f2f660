"""optim="adamw_fp8_coat" / "adamw_fp8" with the stock Trainer, and the registration hook."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from hf_fp8.optim import AdamWFp8, register_trainer_optimizers
from hf_fp8.optim import trainer_registry as registry
from tests.tiny_models import TINY


def args(tmp_path, **kwargs) -> TrainingArguments:
    defaults = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    return TrainingArguments(**{**defaults, **kwargs})


def test_registration_is_idempotent_and_names_resolve():
    register_trainer_optimizers()
    register_trainer_optimizers()
    assert OptimizerNames("adamw_fp8_coat") is OptimizerNames.ADAMW_FP8_COAT
    assert OptimizerNames("adamw_fp8") is OptimizerNames.ADAMW_FP8
    values = [m.value for m in OptimizerNames]
    assert values.count("adamw_fp8_coat") == 1 and values.count("adamw_fp8") == 1
    assert "adamw_torch" in values  # built-ins untouched


@pytest.mark.parametrize(("name", "expand"), [("adamw_fp8_coat", True), ("adamw_fp8", False)])
def test_trainer_resolves_the_optimizer(tmp_path, name, expand):
    training_args = args(tmp_path, optim=name, learning_rate=3e-4, adam_beta2=0.95)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    assert cls is AdamWFp8
    assert kwargs == {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "dynamic_range_expansion": expand,
    }


def test_optim_args_are_parsed(tmp_path):
    training_args = args(
        tmp_path,
        optim="adamw_fp8_coat",
        optim_args="group_size=64,dynamic_range_expansion=False,fp8_format=e5m2",
    )
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    assert kwargs["group_size"] == 64
    assert kwargs["dynamic_range_expansion"] is False
    assert kwargs["fp8_format"] == "e5m2"
    bad = args(tmp_path, optim="adamw_fp8", optim_args="block_size=64")
    with pytest.raises(ValueError, match="unknown optim_args key 'block_size'"):
        Trainer.get_optimizer_cls_and_kwargs(bad)
    with pytest.raises(ValueError, match="boolean"):
        registry.parse_optim_args({"dynamic_range_expansion": "maybe"})


def test_rounding_options_reach_the_optimizer(tmp_path):
    """The issue-15 options are reachable from optim_args, typed as AdamWFp8 takes them."""
    training_args = args(
        tmp_path,
        optim="adamw_fp8_coat",
        optim_args="stochastic_rounding=exp_avg_sq,sqrt_second_moment=true,seed=7",
    )
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    assert kwargs["stochastic_rounding"] == "exp_avg_sq"
    assert kwargs["sqrt_second_moment"] is True and kwargs["seed"] == 7
    assert registry.parse_optim_args({"stochastic_rounding": "off"}) == {
        "stochastic_rounding": False
    }
    opt = AdamWFp8([torch.nn.Parameter(torch.zeros(64, 128))], **kwargs)
    assert opt.param_groups[0]["seed"] == 7


def test_moment_format_reaches_the_optimizer(tmp_path):
    """optim_args moment_format=log selects the log codes under adamw_fp8_coat."""
    training_args = args(tmp_path, optim="adamw_fp8_coat", optim_args="moment_format=log")
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    assert kwargs["moment_format"] == "log" and kwargs["dynamic_range_expansion"] is True
    p = torch.nn.Parameter(torch.zeros(64, 128))
    opt = AdamWFp8([p], **kwargs)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["exp_avg_fp8"].dtype == torch.int8
    _, default = Trainer.get_optimizer_cls_and_kwargs(args(tmp_path, optim="adamw_fp8_coat"))
    q = torch.nn.Parameter(torch.zeros(64, 128))
    opt = AdamWFp8([q], **default)
    q.grad = torch.ones_like(q)
    opt.step()
    assert opt.state[q]["exp_avg_fp8"].dtype == torch.float8_e4m3fn  # the default: fp8 codes


def test_hf_argument_parser_accepts_the_names(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "adamw_fp8_coat", "--report_to", "none"]
    )
    assert parsed.optim == OptimizerNames.ADAMW_FP8_COAT


def test_changed_internals_raise_an_informative_error(monkeypatch):
    import transformers.trainer_optimizer  # a lazy submodule: not an attribute until imported

    monkeypatch.delattr(transformers.trainer_optimizer, "_OPTIMIZER_HANDLERS")
    with pytest.raises(RuntimeError, match="optimizer_cls_and_kwargs"):
        register_trainer_optimizers()


def test_changed_context_raises_an_informative_error():
    with pytest.raises(RuntimeError, match="OptimizerContext changed"):
        registry._handler(True, object())


class TokenData(torch.utils.data.Dataset):
    def __init__(self, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (48, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config_cls, model_cls, kwargs = TINY["llama"]
    return model_cls(config_cls(**kwargs))


def train(tmp_path, run: str, resume: str | None = None, **kwargs) -> tuple:
    training_args = args(
        tmp_path / run,
        learning_rate=1e-3,
        max_steps=6,
        per_device_train_batch_size=8,
        save_strategy="steps",
        save_steps=3,
        logging_steps=100,
        seed=0,
        weight_decay=0.01,
        warmup_steps=2,
        **kwargs,
    )
    model = tiny_llama()
    trainer = Trainer(model=model, args=training_args, train_dataset=TokenData(128))
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


@pytest.mark.slow
def test_trainer_checkpoint_resume_is_exact(tmp_path):
    model, trainer = train(tmp_path, "full", optim="adamw_fp8_coat")
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(inner, AdamWFp8)
    quantized = [st for st in inner.state.values() if "exp_avg_fp8" in st]
    # the default moment format of adamw_fp8_coat: E4M3 codes for both moments
    assert quantized and all(st["exp_avg_fp8"].dtype == torch.float8_e4m3fn for st in quantized)
    assert all(st["exp_avg_sq_fp8"].dtype == torch.float8_e4m3fn for st in quantized)
    resumed, _ = train(
        tmp_path, "resumed", resume=str(tmp_path / "full" / "checkpoint-3"), optim="adamw_fp8_coat"
    )
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_public_route_optimizer_cls_and_kwargs(tmp_path):
    training_args = args(tmp_path, max_steps=2, per_device_train_batch_size=8, logging_steps=100)
    model = tiny_llama()
    before = model.model.embed_tokens.weight.detach().clone()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=TokenData(128),
        optimizer_cls_and_kwargs=(AdamWFp8, {"lr": 1e-3, "dynamic_range_expansion": False}),
    )
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(inner, AdamWFp8) and inner.param_groups[0]["dynamic_range_expansion"] is False
    assert not torch.equal(model.model.embed_tokens.weight, before)
