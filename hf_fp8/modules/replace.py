"""Swap ``nn.Linear`` layers of a loaded model for ``Fp8Linear``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hf_fp8.modules.fp8_linear import Fp8Linear

if TYPE_CHECKING:
    from hf_fp8.config import Fp8Config


def matches_module(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """True when ``name`` is one of ``patterns`` or contains one as dotted components
    (``"lm_head"`` matches ``"lm_head"`` and ``"model.lm_head"``, not ``"lm_head2"``)."""
    dotted = f".{name}."
    return any(name == p or f".{p}." in dotted for p in patterns)


def quantize_model(
    model: nn.Module, config: Fp8Config, *, skip: list[str] | None = None
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an ``Fp8Linear``; return it.

    Layers named in ``config.modules_to_not_convert`` or ``skip`` stay in high precision.
    """
    patterns = list(config.modules_to_not_convert or []) + list(skip or [])
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not matches_module(name, patterns)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(linear, config, module_name=name))
    return model
