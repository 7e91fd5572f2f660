"""Calibration of static ``Fp8Experts``: one observer per (projection, expert).

While observing, each experts module runs weight-only (high-precision activations) and its
``_project`` is wrapped on the instance: every projection's input rows, sorted by expert
(``Routing.present()``; token rows are gathered first), reach the observer of the expert
they are routed to, and only those; with a ``TokenMask``, only the rows of real tokens
(padding left out, R27 F1). ``Fp8ParallelExperts`` rows are not tokens (its caller gathered
them): they are observed whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_fp8.calibration.masking import TokenMask
from hf_fp8.calibration.observers import Observer
from hf_fp8.calibration.recipes import observing_recipe
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_parallel_experts import Fp8ParallelExperts


class ExpertsObservation:
    """Observers of one static ``Fp8Experts`` module; ``install`` / ``remove`` the wrapper."""

    def __init__(
        self,
        module: Fp8Experts,
        make: Callable[[], Observer],
        token_mask: TokenMask | None = None,
    ) -> None:
        self.module = module
        # the routing's token_index names real tokens (not rows gathered by the caller)
        self.token_mask = None if isinstance(module, Fp8ParallelExperts) else token_mask
        self.observers = {
            proj: [make() for _ in range(module.num_experts)] for proj in module.layout.projections
        }
        self._recipe = module.recipe

    def install(self) -> None:
        module, method = self.module, type(self.module)._project

        def observed(
            proj: str, x: torch.Tensor, routing: Any, *, from_tokens: bool = False
        ) -> torch.Tensor:
            rows = x[routing.token_index] if from_tokens else x  # sorted by expert
            keep = None if self.token_mask is None else self.token_mask.tokens(routing.num_tokens)
            if keep is not None:  # per sorted row: is its token a real one?
                keep = keep.to(rows.device)[routing.token_index]
            for expert, start, end in routing.present():
                part = rows[start:end]
                self.observers[proj][expert].update(part if keep is None else part[keep[start:end]])
            return method(module, proj, x, routing, from_tokens=from_tokens)

        module._project = observed  # instance attribute: shadows the method while observing
        module.recipe = observing_recipe(self._recipe)

    def remove(self) -> None:
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


def is_static_experts(module: Any) -> bool:
    return isinstance(module, Fp8Experts) and module.recipe.is_static
