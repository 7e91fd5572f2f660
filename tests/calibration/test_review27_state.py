"""R27 F2 (IterableDataset loader), F8 (per-module train flags), F5 (saturation counters
after re-calibration)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.modules.saturation import SaturationCounter


def _static(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Fp8Config("static", **kwargs)
    )


class _Stream(IterableDataset):
    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            yield {"input_ids": torch.randint(1, 128, (6,), generator=gen)}


@pytest.mark.parametrize("progress", [False, True])
def test_a_dataloader_over_an_iterable_dataset(tiny_model_dir, progress):
    model = _static(tiny_model_dir("llama"))
    loader = DataLoader(_Stream(), batch_size=2)
    with pytest.raises(TypeError):
        len(loader)  # the loader has no length
    scales = hf_fp8.calibrate(model, loader, progress=progress)
    # reference: the unquantized model's max |x| over the same batches
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    seen: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda _m, a, n=name: seen.__setitem__(
                n, max(seen.get(n, 0.0), float(a[0].abs().max()))
            )
        )
        for name, m in ref.named_modules()
        if isinstance(m, nn.Linear) and name != "lm_head"
    ]
    with torch.no_grad():
        for batch in loader:
            ref(**batch)
    for h in hooks:
        h.remove()
    for name, amax in seen.items():
        assert scales[name] == pytest.approx(amax / 448, rel=0.05), name


def test_each_module_keeps_its_own_train_flag(tiny_model_dir):
    model = _static(tiny_model_dir("llama"))
    model.train()
    model.model.layers[0].eval()
    model.model.layers[1].mlp.train()
    before = {n: m.training for n, m in model.named_modules()}
    assert len(set(before.values())) == 2  # a mix
    hf_fp8.calibrate(model, [{"input_ids": torch.randint(1, 128, (1, 6))}], progress=False)
    assert {n: m.training for n, m in model.named_modules()} == before


def _clip_warnings(model, ids, calls):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(calls):
                model(ids)
    return [str(w.message) for w in caught if "clipped" in str(w.message)]


def test_recalibration_resets_the_saturation_counters(tiny_model_dir):
    model = _static(tiny_model_dir("llama"), activation_scale=1e-4).eval()  # clips nearly all
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    q = model.model.layers[0].self_attn.q_proj
    every = SaturationCounter.sample_every
    assert _clip_warnings(model, ids, every * 10) == []  # 10 sampled calls: no check yet
    assert q.saturation_fraction() > 0.5
    hf_fp8.calibrate(model, [{"input_ids": ids}], progress=False)
    # reference: the fraction each layer really clips now, measured with hooks
    clipped: dict[str, float] = {}

    def count(module, args, name):
        x = args[0].detach().float()
        clipped[name] = float((x.abs() > float(module.input_scale) * 448).float().mean())

    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=name: count(m, a, n))
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear)
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    low = SaturationCounter.warn_fraction
    assert clipped["model.layers.0.self_attn.q_proj"] < low
    assert q.saturation_fraction() == 0.0  # not the counts under the old scale (0.88)
    too_many = {n for n, f in clipped.items() if f > SaturationCounter.warn_fraction}
    warned = _clip_warnings(model, ids, every * 16)
    # only layers that really clip too much under the new scale (none of the old counts)
    assert len(warned) == len(too_many) < len(clipped) // 2
    for message in warned:
        assert any(f"layer {n} clipped" in message for n in too_many), message
    assert q.saturation_fraction() < low


def test_a_new_input_scale_restarts_the_counter(tiny_model_dir):
    model = _static(tiny_model_dir("llama"), activation_scale=1e-4).eval()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    q = model.model.layers[0].self_attn.q_proj
    every = SaturationCounter.sample_every
    with torch.no_grad():
        for _ in range(every * 10):
            model(ids)
    with torch.no_grad():
        amax = float(
            model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)).abs().max()
        )
    q.set_input_scale(2 * amax / 448)  # clips nothing
    name = "layers.0.self_attn.q_proj "
    assert not any(name in m for m in _clip_warnings(model, ids, every * 16))
    assert q.saturation_fraction() < SaturationCounter.warn_fraction
    # and a scale too small again warns again (the counter still works after a reset)
    q.set_input_scale(1e-4)
    assert any(name in m for m in _clip_warnings(model, ids, every * 16))
