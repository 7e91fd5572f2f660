"""``Fp8ParallelExperts``: FP8 for "parallel experts" linears (one ``[E, out, in]`` weight,
rows pre-sorted by expert with their counts).

JetMoE's ``JetMoeParallelExperts`` (97.6 % of JetMoE-8B's parameters: the MLP experts and the
mixture-of-attention experts) is the ScatterMoE / Megablocks convention: ``weight [E, out,
in]`` and ``forward(inputs [S, in], expert_size)`` = ``inputs.split(expert_size)`` then
``F.linear(chunk_e, weight[e])`` per expert, concatenated. It is a linear per expert, outside
transformers' experts interface. :func:`parallel_experts_layout` recognises the structure
from the module (no list of names): exactly one parameter ``weight`` of 3 dims, no buffers
or children, a forward of two arguments whose source splits its input and calls ``linear``
on ``self.weight[...]``, and does nothing else (``hf_fp8.modules.forward_ops``). Anything else stays in high precision with its reason.

``Fp8ParallelExperts`` is an ``Fp8Experts`` with one projection, ``weight`` (storage
``weight`` fp8 ``[E, out, in]``, ``weight_weight_scale``, static ``weight_input_scale``
``[E]``), so the quantizer, calibration, save / reload and ``dequantize`` are
``Fp8Experts``'; the call computes each expert's rows with the grouped FP8 linear.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from hf_fp8.kernels.grouped import Routing
from hf_fp8.modules.forward_ops import forward_ops
from hf_fp8.modules.fp8_experts import (
    ExpertsLayout,
    Fp8Experts,
    checked_source_layout,
    experts_layout,
)


@dataclass(frozen=True)
class ParallelExpertsLayout(ExpertsLayout):
    """One projection, ``weight`` ``[E, out, in]`` (``intermediate_size`` = out,
    ``hidden_size`` = in)."""

    @property
    def projections(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("weight",)

    def shape(self, projection: str) -> tuple[int, int, int]:
        return (self.num_experts, self.intermediate_size, self.hidden_size)


def parallel_experts_layout(module: nn.Module) -> ParallelExpertsLayout | None:
    """The layout of a parallel experts linear (see the module docstring), else ``None``."""
    if isinstance(module, Fp8Experts) or experts_layout(module) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 3:
        return None
    if any(True for _ in module.buffers()) or any(True for _ in module.children()):
        return None
    args = list(inspect.signature(type(module).forward).parameters)[1:]
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    if len(args) != 2 or ".split(" not in source or "self.weight[" not in source:
        return None
    if "linear(" not in source:
        return None
    ops = forward_ops(module)  # split, one linear per expert, cat; nothing else
    allowed = {".split", "split", "range", ".append", "linear", "cat"}
    if ops is None or not ops.only(allowed, (), {"For"}):
        return None
    num_experts, out_features, in_features = params["weight"].shape
    return ParallelExpertsLayout(
        source_class=type(module),
        num_experts=int(num_experts),
        hidden_size=int(in_features),
        intermediate_size=int(out_features),
        has_gate=False,
        has_bias=False,
        is_transposed=False,
        is_concatenated=False,
        has_post_expert_norm=False,
        forward_args=tuple(args),
    )


class Fp8ParallelExperts(Fp8Experts):
    """FP8 ``JetMoeParallelExperts``-style linear: ``forward(inputs, expert_size)``."""

    @classmethod
    def _source_layout(cls, module: nn.Module, module_name: str) -> ExpertsLayout:
        return checked_source_layout(
            module, module_name, parallel_experts_layout(module), "a parallel experts linear"
        )

    def forward(self, inputs: torch.Tensor, expert_size) -> torch.Tensor:  # type: ignore[override]
        """``inputs [S, in]`` sorted by expert, ``expert_size`` rows per expert (ints) ->
        ``[S, out]``, as the source's ``split`` + per-expert ``F.linear``."""
        self._check_not_parametrized()
        self._check_call()
        self._check_frozen()
        counts = tuple(int(c) for c in expert_size)
        if len(counts) != self.num_experts or sum(counts) != inputs.shape[0]:
            raise ValueError(
                f"expert_size {list(counts)[:8]} must give one count per expert "
                f"({self.num_experts}) summing to the {inputs.shape[0]} input rows"
            )
        expert_ids = torch.repeat_interleave(
            torch.arange(self.num_experts, device=inputs.device),
            torch.tensor(counts, device=inputs.device),
        )
        rows = torch.arange(inputs.shape[0], device=inputs.device)
        routing = Routing(
            pair_index=rows,
            token_index=rows,
            expert_ids=expert_ids,
            counts=counts,
            num_tokens=inputs.shape[0],
            top_k=1,
        )
        return self._project("weight", inputs, routing)
