"""The swap of ``nn.Linear`` (and GPT-2 ``Conv1D``) layers for ``Fp8Linear`` (private helpers of
``hf_fp8.quantize_model``; which layers convert is ``hf_fp8.modules.selection``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.modules.origin import mark_source_class
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


def shared_scale(config: Fp8Config, keys: Sequence[str]) -> float | None:
    """The static activation scale of one module known under several ``activation_scales``
    ``keys`` (a module shared by two parents: its full name under each): the config's entry
    for any of them, whichever name it uses (it names exactly this module), else the fallback
    ``activation_scale``. Entries that differ are refused (``ValueError`` naming them): a
    shared module has one input scale, and keeping either would be a guess."""
    scales = config.activation_scales or {}
    given = {key: scales[key] for key in keys if key in scales}
    if len(set(given.values())) > 1:
        raise ValueError(
            f"activation_scales gives different scales {given} to one module shared under the "
            f"names {list(keys)}: a shared module has one input scale. Keep one of these keys, "
            "or give them the same value"
        )
    return next(iter(given.values())) if given else config.activation_scale


def _build_linears(
    config: Fp8Config, targets: list[tuple[str, nn.Module, nn.Module]]
) -> list[tuple[nn.Module, str, nn.Module]]:
    """An ``Fp8Linear`` quantized with ``config`` for each ``(name, module, parent)`` of
    ``targets`` (``convertible_modules``), as ``(parent, attribute, new)``; changes nothing
    (:func:`swapped_modules` installs them). A layer shared by several parents is quantized
    once and stays shared; its input scale is the one ``activation_scales`` gives under any
    of its names (:func:`shared_scale`, checked for every layer before any is quantized)."""
    names: dict[int, list[str]] = {}
    for name, module, _ in targets:
        names.setdefault(id(module), []).append(name)
    scales = {key: shared_scale(config, found) for key, found in names.items() if len(found) > 1}
    done: dict[int, Fp8Linear] = {}
    swaps = []
    for name, module, parent in targets:
        new = done.get(id(module))
        if new is None:
            new = Fp8Linear.from_linear(as_linear(module), config, module_name=name)
            mark_source_class(new, module)  # a Conv1D dequantizes to a Conv1D (R31, HF28)
            scale = scales.get(id(module))
            if scale is not None and scale != config.activation_scale_for(name):
                new.set_input_scale(scale)  # given under another of its names
            done[id(module)] = new
        swaps.append((parent, name.rpartition(".")[2], new))
    return swaps


def _build_experts(
    config: Fp8Config, experts: list[tuple[str, nn.Module, nn.Module, type]]
) -> list[tuple[nn.Module, str, nn.Module]]:
    """As :func:`_build_linears` for MoE experts (``(name, module, parent, fp8_class)`` of
    ``experts_to_convert``): an experts module shared by several parents is converted once and
    stays shared; each projection's input scale is the one ``activation_scales`` gives under
    any of its names (``<name>.<projection>``, :func:`shared_scale`)."""
    names: dict[int, list[str]] = {}
    for name, module, _, _ in experts:
        names.setdefault(id(module), []).append(name)
    built: dict[int, nn.Module] = {}
    swaps = []
    for name, module, parent, fp8_class in experts:
        new = built.get(id(module))
        if new is None:
            new = fp8_class.from_experts(module, config, module_name=name)
            found = names[id(module)]
            for proj in new.layout.projections if len(found) > 1 else ():
                scale = shared_scale(config, [f"{n}.{proj}" for n in found])
                if scale is not None and scale != config.activation_scale_for(f"{name}.{proj}"):
                    new.set_input_scale(proj, scale)  # given under another of its names
            built[id(module)] = new
        swaps.append((parent, name.rpartition(".")[2], new))
    return swaps


@contextlib.contextmanager
def swapped_modules(swaps: list[tuple[nn.Module, str, nn.Module]]) -> Iterator[None]:
    """Set every ``(parent, attribute, new)`` of ``swaps``, then run the block; when the swap
    or the block raises (``KeyboardInterrupt`` too), every original is put back: the model is
    as it was, never half-converted."""
    olds: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for parent, attr, new in swaps:
            olds.append((parent, attr, getattr(parent, attr)))
            setattr(parent, attr, new)
        yield
    except BaseException:
        for parent, attr, old in reversed(olds):
            setattr(parent, attr, old)
        raise
