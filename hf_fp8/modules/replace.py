"""Swap ``nn.Linear`` layers of a loaded model for ``Fp8Linear``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.modules.selection import is_conv1d, matches_module

if TYPE_CHECKING:
    from hf_fp8.config import Fp8Config


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return module.weight.shape[0], module.nf
    return module.in_features, module.out_features


def as_linear(module: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` view of a ``Conv1D`` (weight transposed); linears pass through."""
    if not is_conv1d(module):
        return module
    in_features, out_features = linear_shape(module)
    with torch.device("meta"):
        linear = nn.Linear(in_features, out_features, module.bias is not None)
    linear.weight = nn.Parameter(module.weight.detach().t())
    if module.bias is not None:
        linear.bias = module.bias
    return linear


def quantize_model(
    model: nn.Module, config: Fp8Config, *, skip: list[str] | None = None
) -> nn.Module:
    """Replace every ``nn.Linear`` (and GPT-2 ``Conv1D``) of ``model`` (in place) by an ``Fp8Linear``; return it.

    Layers named in ``config.modules_to_not_convert`` or ``skip`` stay in high precision.
    """
    patterns = list(config.modules_to_not_convert or []) + list(skip or [])
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if (type(module) is nn.Linear or is_conv1d(module)) and not matches_module(name, patterns)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(as_linear(linear), config, module_name=name))
    return model
