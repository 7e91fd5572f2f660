"""The swap of ``nn.Linear`` (and GPT-2 ``Conv1D``) layers for ``Fp8Linear`` (private helpers of
``hf_fp8.quantize_model``; which layers convert is ``hf_fp8.modules.selection``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.modules.selection import is_conv1d, matches_module  # noqa: F401 (re-exported)

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


def _swap_linears(config: Fp8Config, targets: list[tuple[str, nn.Module, nn.Module]]) -> list[str]:
    """Replace each ``(name, module, parent)`` of ``targets`` (``convertible_modules``) by an
    ``Fp8Linear`` quantized with ``config``, in place; return the converted names.

    A layer shared by several parents is quantized once and stays shared. The public entry
    point is ``hf_fp8.quantize_model`` (``hf_fp8.quantizer.convert``).
    """
    done: dict[int, Fp8Linear] = {}
    for name, module, parent in targets:
        new = done.get(id(module))
        if new is None:
            new = Fp8Linear.from_linear(as_linear(module), config, module_name=name)
            done[id(module)] = new
        setattr(parent, name.rpartition(".")[2], new)
    return [name for name, _, _ in targets]
