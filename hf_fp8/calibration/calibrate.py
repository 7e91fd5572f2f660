"""``calibrate``: static FP8 activation scales from data."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_fp8.calibration.observers import make_observer
from hf_fp8.modules import Fp8Linear
from hf_fp8.numerics import fp8_dtype


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _run(model: nn.Module, batch: Any) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (list, tuple)):
        model(*batch)
    else:
        model(batch)


@torch.no_grad()
def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    observer: str = "minmax",
    *,
    progress: bool = True,
    **observer_kwargs: Any,
) -> dict[str, float]:
    """Set the ``input_scale`` of every static ``Fp8Linear`` from ``batches``.

    ``batches`` yields model inputs: a dict (``model(**batch)``, e.g. a tokenizer's output),
    a tuple (``model(*batch)``) or a tensor. ``observer``: ``"minmax"``,
    ``"moving_average"``, ``"percentile"`` (``percentile=99.99``) or ``"mse"``. During
    calibration the static layers run with high-precision activations. The model's
    train/eval mode is restored. Returns the scales by module name.
    """
    layers = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear) and m.activation_scheme == "static"
    }
    if not layers:
        raise ValueError(
            "the model has no static FP8 layers to calibrate: load or quantize it with "
            "Fp8Config('static')"
        )
    observers = {
        name: make_observer(observer, fp8_dtype(m.fp8_format), **observer_kwargs)
        for name, m in layers.items()
    }
    hooks = [
        m.register_forward_pre_hook(lambda _m, args, obs=observers[name]: obs.update(args[0]))
        for name, m in layers.items()
    ]
    was_training = model.training
    for m in layers.values():
        m.activation_scheme = "weight_only"  # observe unquantized activations
    device = next(model.parameters()).device
    try:
        model.eval()
        total = len(batches) if hasattr(batches, "__len__") else None
        for batch in tqdm(batches, total=total, desc="calibrating", disable=not progress):
            _run(model, _to_device(batch, device))
    finally:
        for h in hooks:
            h.remove()
        for m in layers.values():
            m.activation_scheme = "static"
        model.train(was_training)
    scales = {}
    for name, m in layers.items():
        scale = observers[name].scale()
        m.set_input_scale(scale)
        scales[name] = float(scale)
    return scales
