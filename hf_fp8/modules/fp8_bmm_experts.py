"""``Fp8BmmExperts``: FP8 for experts modules that multiply pre-grouped tokens with ``bmm``.

Some MoE experts modules of transformers 5.24 are not built on
``use_experts_implementation`` yet hold fused 3-D weights: Llama-4's ``Llama4TextExperts``
(91 % of Llama-4 Scout's parameters) takes ``hidden_states [E * T, H]`` — every token
repeated once per expert, scaled by its router score (0 for an expert it is not routed to) —
and computes ``bmm(x.view(E, T, H), gate_up_proj [E, H, 2I])``, ``gate, up = chunk(2)``,
``bmm(up * act_fn(gate), down_proj [E, I, H])``. :func:`bmm_experts_layout` recognises that
structure from the module itself (no list of names): exactly the parameters
``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``, a parameter-free ``act_fn``, a
forward of one argument whose source multiplies both with ``bmm`` and splits the first
product with ``chunk(2)`` into ``gate, up`` with ``act_fn(gate)``, and does nothing else
(``hf_fp8.modules.forward_ops``: no other call, arithmetic or branch). Anything else stays in
high precision with ``unsupported_reason`` (``hf_fp8.modules.fp8_experts``) naming why.

``Fp8BmmExperts`` is an ``Fp8Experts`` (same storage ``[E, out, in]``, scales, recipe,
calibration, save / reload, ``dequantize`` back to the source class); only the call
differs: rows that are entirely zero (tokens not routed to that expert) give zero outputs
in the source (no bias: ``act(0) * 0 = 0``), so only the non-zero rows are computed, grouped
by expert (``hf_fp8.kernels.grouped``), and the others are left zero.
"""

from __future__ import annotations

import inspect
import re

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

_CHUNK = re.compile(r"(\w+)\s*,\s*(\w+)\s*=\s*\w+\.chunk\(\s*2")
_ACT = re.compile(r"self\.act_fn\(\s*(\w+)\s*\)")


def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def bmm_experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of a bmm experts module (see the module docstring), else ``None``."""
    if isinstance(module, Fp8Experts) or experts_layout(module) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    up, down = params.get("gate_up_proj"), params.get("down_proj")
    if set(params) != {"gate_up_proj", "down_proj"} or up.dim() != 3 or down.dim() != 3:
        return None
    num_experts, hidden, width = up.shape
    if width % 2 or tuple(down.shape) != (num_experts, width // 2, hidden):
        return None
    if next(module.buffers(), None) is not None:  # one exists (its value does not count)
        return None
    if {n for n, _ in module.named_children()} != {"act_fn"}:
        return None
    if any(True for _ in module.act_fn.parameters()):
        return None
    args = list(inspect.signature(type(module).forward).parameters)[1:]
    source = _forward_source(type(module))
    chunk, act = _CHUNK.search(source), _ACT.search(source)
    ops = forward_ops(module)
    if (
        len(args) != 1
        or ops is None  # nothing but views, the two bmm, chunk, act_fn and up * act(gate)
        or not ops.only(
            {".view", ".reshape", "reshape", "bmm", ".chunk", "self.act_fn"}, ("Mult",), set()
        )
        or "bmm(" not in source
        or "self.gate_up_proj" not in source
        or "self.down_proj" not in source
        or chunk is None
        or act is None
        or act.group(1) != chunk.group(1)  # gate first, the activation on the gate
    ):
        return None
    return ExpertsLayout(
        source_class=type(module),
        num_experts=int(num_experts),
        hidden_size=int(hidden),
        intermediate_size=int(width // 2),
        has_gate=True,
        has_bias=False,
        is_transposed=True,
        is_concatenated=True,
        has_post_expert_norm=False,
        forward_args=tuple(args),
    )


class Fp8BmmExperts(Fp8Experts):
    """FP8 ``Llama4TextExperts``-style experts: the call takes ``[E * T, H]`` rows grouped
    by expert; storage and everything else are ``Fp8Experts``'."""

    @classmethod
    def _source_layout(cls, module: nn.Module, module_name: str) -> ExpertsLayout:
        return checked_source_layout(
            module, module_name, bmm_experts_layout(module), "a bmm experts module"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[E * T, H]`` rows grouped by expert (the source's call) -> ``[E * T, H]``."""
        self._check_not_parametrized()
        self._check_call()
        self._check_frozen()
        num_experts, hidden = self.num_experts, self.layout.hidden_size
        x = hidden_states.reshape(num_experts, -1, hidden)
        live = (x != 0).any(dim=-1)  # [E, T]; a NaN row is live and stays NaN
        expert_ids, token_ids = live.nonzero(as_tuple=True)  # sorted by expert, then token
        counts = tuple(int(c) for c in live.sum(dim=1).tolist())
        routing = Routing(
            pair_index=expert_ids * x.shape[1] + token_ids,
            token_index=token_ids,
            expert_ids=expert_ids,
            counts=counts,
            num_tokens=x.shape[1],
            top_k=num_experts,
        )
        h = self._project("gate_up_proj", x[expert_ids, token_ids], routing)
        gate, up = h.chunk(2, dim=-1)
        h = self._project("down_proj", up * self.act_fn(gate), routing)
        out = x.new_zeros(x.shape)
        out[expert_ids, token_ids] = h.to(out.dtype)
        return out.view(-1, hidden)
