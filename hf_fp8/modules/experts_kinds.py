"""The experts modules outside transformers' experts interface that hf_fp8 still converts,
each recognised from its structure by a layout function: Llama-4's bmm experts
(``Fp8BmmExperts``) and JetMoE's parallel experts linears (``Fp8ParallelExperts``).
Modules on the interface are ``Fp8Experts``' (``hf_fp8.modules.fp8_experts``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from hf_fp8.modules.fp8_bmm_experts import Fp8BmmExperts, bmm_experts_layout
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts, parallel_experts_layout

OUTSIDE_INTERFACE: tuple[tuple[Callable[[nn.Module], object], type[Fp8Experts]], ...] = (
    (bmm_experts_layout, Fp8BmmExperts),
    (parallel_experts_layout, Fp8ParallelExperts),
)


def outside_interface_class(module: nn.Module) -> type[Fp8Experts] | None:
    """The FP8 class that converts ``module`` when it is one of the experts kinds outside
    transformers' interface (``None`` otherwise)."""
    for layout, cls in OUTSIDE_INTERFACE:
        if layout(module) is not None:
            return cls
    return None


def convertible_outside_experts(
    model: nn.Module,
    *,
    skip: Sequence[str] = (),
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> list[tuple[str, nn.Module, nn.Module, type[Fp8Experts]]]:
    """``(name, module, parent, fp8_class)`` of every such module of ``model`` that converts
    (not named in ``skip``, accepted by ``module_filter_fn``), once per parent."""
    from hf_fp8.modules.selection import matches_module

    found = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            cls = outside_interface_class(child)
            if cls is None or matches_module(name, skip):
                continue
            if module_filter_fn is None or module_filter_fn(child, name):
                found.append((name, child, parent, cls))
    return found
