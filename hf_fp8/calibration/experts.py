"""Calibration of static ``Fp8Experts``: one observer per (projection, expert).

While observing, each experts module runs weight-only (high-precision activations) and its
``_project`` is wrapped on the instance: every projection's input rows, sorted by expert
(``Routing.present()``; token rows are gathered first), reach the observer of the expert
they are routed to, and only those; with a ``TokenMask``, only the rows of real tokens
(padding left out, R27 F1).

``Fp8ParallelExperts`` (JetMoE's ``forward(inputs, expert_size)``) get rows their caller
gathered: row ``i`` is a copy of (or computed from) token ``batch_index[i]``, an index the
caller's router returned together with ``expert_size`` (JetMoE's ``JetMoeTopKGating``:
``(index_sorted_experts, batch_index, batch_gates, expert_size, logits)``; the MoE and both
attention-expert calls pass that very ``expert_size`` object on). :class:`RouterOutputs`
keeps the latest tuple each module next to the experts (the experts' parent's other
modules) returned; at each call the one holding the ``expert_size`` object passed (by
identity, not by value) names the rows' tokens: the one integer tensor in it of one entry
per row with every token of the batch exactly ``rows / tokens`` times and no (token,
expert) pair twice. When no tuple holds it, or no single index fits (a router that drops
tokens, two candidates that differ), the rows are observed whole, and ``calibrate`` warns
naming the module once a padded batch reached it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hf_fp8.calibration.masking import TokenMask
from hf_fp8.calibration.observers import Observer
from hf_fp8.calibration.recipes import observing_recipe
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts


class RouterOutputs:
    """The latest tuple / list output of every module under ``parent`` but experts."""

    def __init__(self, parent: nn.Module) -> None:
        self.parent = parent
        self.outputs: dict[int, tuple | list] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        for module in self.parent.modules():
            if module is not self.parent and not isinstance(module, Fp8Experts):
                self._handles.append(module.register_forward_hook(self._record))

    def _record(self, module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, (tuple, list)):
            self.outputs[id(module)] = output  # kept alive: identity checks stay sound

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.outputs = {}

    def holding(self, obj: Any) -> list[tuple | list]:
        """The recorded outputs that hold ``obj`` itself (``is``)."""
        return [out for out in self.outputs.values() if any(item is obj for item in out)]


def _token_of_row(
    outputs: Sequence[tuple | list], counts: Sequence[int], token_mask: TokenMask
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(token index per row, keep mask over those tokens or None: all real)`` of a parallel
    experts call with ``counts`` rows per expert, from the router ``outputs``; None when no
    single index fits (see the module docstring)."""
    rows = sum(counts)
    totals = {shape[0] * shape[1] for shape in token_mask.keeps}
    found: list[tuple[torch.Tensor, int]] = []
    expert = None
    for out in outputs:
        for item in out:
            if not (
                isinstance(item, torch.Tensor)
                and item.dim() == 1
                and item.shape[0] == rows
                and rows > 0
                and not item.is_floating_point()
                and not item.is_complex()
                and item.dtype != torch.bool
            ):
                continue
            for tokens in totals:
                if rows % tokens or int(item.min()) < 0 or int(item.max()) >= tokens:
                    continue
                per_token = torch.bincount(item, minlength=tokens)
                if not bool((per_token == rows // tokens).all()):
                    continue  # a router that drops or repeats tokens: not a plain top-k
                if expert is None:
                    expert = torch.repeat_interleave(
                        torch.arange(len(counts), device=item.device),
                        torch.tensor(list(counts), device=item.device),
                    )
                if torch.unique(item.long() * len(counts) + expert).numel() != rows:
                    continue  # a token twice in one expert's rows
                if not any(n == tokens and torch.equal(t, item) for t, n in found):
                    found.append((item, tokens))
    if len(found) != 1:
        return None
    index, tokens = found[0]
    shapes = [shape for shape in token_mask.keeps if shape[0] * shape[1] == tokens]
    if len(shapes) != 1:
        return None  # two masks with this many tokens: which one is unknown
    keep = token_mask.keeps[shapes[0]]
    return index, None if keep is None else keep.reshape(-1)


class ExpertsObservation:
    """Observers of one static ``Fp8Experts`` module; ``install`` / ``remove`` the wrapper.

    ``parents``: the modules holding ``module`` (its router's siblings), for
    ``Fp8ParallelExperts`` only."""

    def __init__(
        self,
        module: Fp8Experts,
        make: Callable[[], Observer],
        token_mask: TokenMask | None = None,
        parents: Sequence[nn.Module] = (),
    ) -> None:
        self.module = module
        self.token_mask = token_mask
        self.parallel = isinstance(module, Fp8ParallelExperts)
        self.routers = [RouterOutputs(p) for p in parents] if self.parallel else []
        self.untraced = 0  # padded calls whose rows could not be traced to their tokens
        self._row_keep: torch.Tensor | None = None
        self._handle: Any = None
        self.observers = {
            proj: [make() for _ in range(module.num_experts)] for proj in module.layout.projections
        }
        self._recipe = module.recipe

    def _before_call(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Parallel experts: which of this call's rows are real tokens' (``_row_keep``)."""
        self._row_keep = None
        mask = self.token_mask
        if mask is None or all(keep is None for keep in mask.keeps.values()):
            return  # nothing is padding
        names = self.module.layout.forward_args
        expert_size = args[1] if len(args) > 1 else kwargs.get(names[1] if names else "")
        try:
            counts = [int(c) for c in expert_size]
        except TypeError:
            counts = None
        outputs = [out for r in self.routers for out in r.holding(expert_size)]
        traced = None if counts is None else _token_of_row(outputs, counts, mask)
        if traced is None:
            self.untraced += 1
            return
        index, keep = traced
        self._row_keep = None if keep is None else keep.to(index.device)[index]

    def install(self) -> None:
        module, method = self.module, type(self.module)._project

        def observed(
            proj: str, x: torch.Tensor, routing: Any, *, from_tokens: bool = False
        ) -> torch.Tensor:
            rows = x[routing.token_index] if from_tokens else x  # sorted by expert
            if self.parallel:  # rows gathered by the caller: traced in _before_call
                keep = self._row_keep
            else:  # the routing's token_index names real tokens
                keep = (
                    None if self.token_mask is None else self.token_mask.tokens(routing.num_tokens)
                )
                if keep is not None:  # per sorted row: is its token a real one?
                    keep = keep.to(rows.device)[routing.token_index]
            if keep is not None:
                keep = keep.to(rows.device)
            for expert, start, end in routing.present():
                part = rows[start:end]
                self.observers[proj][expert].update(part if keep is None else part[keep[start:end]])
            return method(module, proj, x, routing, from_tokens=from_tokens)

        if self.parallel:
            for router in self.routers:
                router.install()
            self._handle = module.register_forward_pre_hook(self._before_call, with_kwargs=True)
        module._project = observed  # instance attribute: shadows the method while observing
        module.recipe = observing_recipe(self._recipe)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for router in self.routers:
            router.remove()
        self._row_keep = None
        self.module.__dict__.pop("_project", None)
        self.module.recipe = self._recipe

    def names(self, name: str) -> dict[str, Observer]:
        """``{"<module>.<proj>[<expert>]": observer}``, the keys ``calibrate`` reports."""
        return {
            f"{name}.{proj}[{expert}]": obs
            for proj, observers in self.observers.items()
            for expert, obs in enumerate(observers)
        }

    def current_scale(self, proj: str, expert: int) -> float | None:
        """The input scale this expert had before calibration, if any."""
        scale = getattr(self.module, f"{proj}_input_scale")
        if scale is None or scale.is_meta:
            return None
        return float(scale[expert])

    def apply(self, name: str, scales: dict[str, float]) -> None:
        """Write ``scales`` (keyed as :meth:`names`) into the module, one ``[E]`` per proj."""
        for proj, observers in self.observers.items():
            values = [scales[f"{name}.{proj}[{e}]"] for e in range(len(observers))]
            self.module.set_input_scale(proj, torch.tensor(values, dtype=torch.float32))


def parents_of(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` that holds ``module`` as a child (a shared module: several)."""
    out: dict[int, nn.Module] = {}
    for parent in model.modules():
        if any(child is module for child in parent.children()):
            out[id(parent)] = parent
    return list(out.values())


def is_static_experts(module: Any) -> bool:
    return isinstance(module, Fp8Experts) and module.recipe.is_static
