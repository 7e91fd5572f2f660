"""DistributedDataParallel of FP8 models (one-rank gloo world, in process): hf_fp8.ddp and the
``accelerate_ddp`` patch of ``Accelerator.prepare_model``, compared with the same steps
without DDP."""

from __future__ import annotations

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_fp8
from hf_fp8 import patches
from hf_fp8.ddp import FP8_DTYPES, fp8_tensors, ignore_fp8_for_ddp
from hf_fp8.patches import accelerate_ddp
from hf_fp8.patches.accelerate_ddp import MANUAL

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)
DDP = torch.nn.parallel.DistributedDataParallel
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_world(monkeypatch):
    """A one-rank gloo process group and the environment of accelerate's MULTI_CPU launch."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # accelerate would reset the threads
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        import sys

        if "accelerate.state" in sys.modules:
            sys.modules["accelerate.state"].AcceleratorState._reset_state(True)
        dist.destroy_process_group()


@pytest.fixture
def accelerator(gloo_world):
    """``Accelerator(cpu=True)`` in MULTI_CPU mode, with the ``accelerate_ddp`` patch on."""
    import accelerate

    if not accelerate_ddp.applied():  # registered patches are applied on import already
        accelerate_ddp.apply()
    acc = accelerate.Accelerator(cpu=True)
    assert str(acc.distributed_type) == "DistributedType.MULTI_CPU", acc.distributed_type
    return acc


def _mlp(scheme: str = "dynamic") -> nn.Module:
    """Two FP8 layers (trainable biases) and a trainable high-precision head."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )
    hf_fp8.quantize_model(model, hf_fp8.Fp8Config(scheme), skip=["4"], default_skips=False)
    if scheme == "static":
        hf_fp8.calibrate(model, [torch.randn(16, 32)], progress=False)
    return model


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 32, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(n)]


def _train(model: nn.Module, trained: nn.Module, *, backward=None) -> list[float]:
    """AdamW steps of ``model`` (maybe DDP-wrapped) on the parameters of ``trained``."""
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for x, y in _batches():
        loss = nn.functional.mse_loss(model(x), y)
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    got, want = actual.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert (
            torch.equal(got[key].view(torch.uint8), value.view(torch.uint8))
            if (value.dtype in FP8_DTYPES)
            else torch.equal(got[key], value)
        ), key


@pytest.mark.parametrize("scheme", ["dynamic", "static", "weight_only"])
def test_only_fp8_codes_are_ignored(scheme):
    model = _mlp(scheme)
    names = ignore_fp8_for_ddp(model)
    assert names == ["0.weight", "2.weight"]
    assert all(model.get_parameter(n).dtype == torch.float8_e4m3fn for n in names)
    # biases, scales (input_scale too: calibration may change it) and the head stay with DDP
    kept = {n for n, p in model.named_parameters()} - set(names)
    assert {"0.bias", "0.weight_scale", "2.bias", "4.weight", "4.bias"} <= kept
    assert ("0.input_scale" in kept) == (scheme == "static")
    assert model._ddp_params_and_buffers_to_ignore == names
    assert ignore_fp8_for_ddp(model) == names  # again: harmless, nothing doubled
    assert model._ddp_params_and_buffers_to_ignore == names


def test_user_ignore_list_is_kept():
    model = _mlp()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["4.bias"])
    ignore_fp8_for_ddp(model, broadcast=False)
    assert model._ddp_params_and_buffers_to_ignore == ["4.bias", "0.weight", "2.weight"]


def test_trainable_fp8_parameter_is_refused():
    model = _mlp()
    model[2].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"2\.weight.*requires_grad_\(False\)"):
        ignore_fp8_for_ddp(model)


def test_wrapped_model_is_refused(gloo_world):
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="before it is wrapped"):
        ignore_fp8_for_ddp(DDP(model))


def test_plain_ddp_fails_without_the_helper(gloo_world):
    """R8's finding, kept as the reason for the helper: torch's bare error."""
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        DDP(_mlp())


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_ddp_steps_match_the_same_steps_without_ddp(gloo_world, scheme):
    model, reference = _mlp(scheme), _mlp(scheme)
    ignore_fp8_for_ddp(model)
    ddp = DDP(model)
    assert _train(ddp, model) == _train(reference, reference)
    _assert_same_state(model, reference)  # bit-exact: one rank averages over one
    assert not torch.equal(model[4].weight, _mlp(scheme)[4].weight)  # it did train


def test_accelerate_prepare_without_the_patch_fails(accelerator):
    """What ``accelerator.prepare`` does in MULTI_CPU mode without hf_fp8's patch."""
    from accelerate import Accelerator

    unpatched = Accelerator.prepare_model.__wrapped__
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        unpatched(accelerator, _mlp())


def test_accelerate_prepare_builds_ddp_and_matches(accelerator):
    model, reference = _mlp(), _mlp()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ddp, opt = accelerator.prepare(model, opt)
    assert isinstance(ddp, DDP) and ddp.module is model
    losses = []
    for x, y in _batches():
        loss = nn.functional.mse_loss(ddp(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == _train(reference, reference)
    _assert_same_state(model, reference)


def test_accelerate_lora_on_fp8_llama_matches(accelerator):
    from tests.integration.test_ddp_two_ranks import lora_fp8_llama

    model, reference = lora_fp8_llama(), lora_fp8_llama()
    assert len(fp8_tensors(model)) == 14  # 7 linears x 2 layers
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    ddp, opt = accelerator.prepare(model, opt)
    assert isinstance(ddp, DDP)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(STEPS):
        for m, o, backward in ((ddp, opt, accelerator.backward), (reference, ref_opt, None)):
            loss = m(input_ids=ids, labels=ids).loss
            (backward or torch.Tensor.backward)(loss)
            o.step()
            o.zero_grad()
    _assert_same_state(model, reference)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.weight.dtype in FP8_DTYPES


def test_accelerate_refuses_trainable_fp8(accelerator):
    model = _mlp()
    model[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"0\.weight"):
        accelerator.prepare(model)


def test_accelerate_eval_mode_and_high_precision_models_untouched(accelerator):
    model = _mlp()
    accelerator.prepare_model(model, evaluation_mode=True)
    assert "_ddp_params_and_buffers_to_ignore" not in model.__dict__
    plain = nn.Linear(4, 4)
    assert isinstance(accelerator.prepare(plain), DDP)
    assert "_ddp_params_and_buffers_to_ignore" not in plain.__dict__


def test_patch_fails_alone(monkeypatch):
    """A missing accelerate internal disables the patch with one warning naming the route."""
    import accelerate.accelerator as acc_module

    if "accelerate_ddp" not in patches.PATCHES:  # until registered (test_registered says so)
        entry = patches.Patch(accelerate_ddp.__name__, (accelerate_ddp.TRIGGER,), "DDP", MANUAL)
        monkeypatch.setitem(patches.PATCHES, "accelerate_ddp", entry)
    monkeypatch.setattr(patches, "_STATUS", {})
    monkeypatch.setattr(acc_module.Accelerator, "prepare_model", lambda self, model: model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert patches.apply("accelerate_ddp") is False
        assert patches.apply("accelerate_ddp") is False
    assert len(caught) == 1 and issubclass(caught[0].category, patches.PatchWarning)
    message = str(caught[0].message)
    assert "evaluation_mode" in message and "ignore_fp8_for_ddp" in message
    assert patches.status()["accelerate_ddp"].startswith("off")


def test_registered():
    """The patch is in hf_fp8.patches' table and triggered by importing accelerate."""
    entry = patches.PATCHES.get("accelerate_ddp")
    assert entry is not None, "register the patch in hf_fp8/patches/__init__.py (PATCHES)"
    assert entry.module == accelerate_ddp.__name__ and accelerate_ddp.TRIGGER in entry.triggers
    import accelerate  # noqa: F401

    assert accelerate_ddp.applied()
    assert hf_fp8.ignore_fp8_for_ddp is ignore_fp8_for_ddp


def test_trainer_in_multi_cpu_mode_trains_lora_on_fp8(gloo_world, tmp_path):
    """The stock Trainer prepares through accelerate: DDP without user code."""
    import accelerate  # noqa: F401
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from hf_fp8.utils.tiny import tiny_llama_config

    if not accelerate_ddp.applied():
        accelerate_ddp.apply()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(64, 2, 32))
    hf_fp8.quantize_model(model, hf_fp8.Fp8Config("dynamic"), skip=["lm_head"])
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    codes = {k: v.view(torch.uint8).clone() for k, v in fp8_tensors(model).items()}
    adapters = {k: v.clone() for k, v in model.named_parameters() if v.requires_grad}
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    args = TrainingArguments(
        str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=[], save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids]
    )
    assert str(trainer.accelerator.distributed_type) == "DistributedType.MULTI_CPU"
    trainer.train()
    assert isinstance(trainer.model_wrapped, DDP)
    assert all(torch.equal(v.view(torch.uint8), codes[k]) for k, v in fp8_tensors(model).items())
    params = dict(model.named_parameters())
    assert any(not torch.equal(params[k], v) for k, v in adapters.items())
