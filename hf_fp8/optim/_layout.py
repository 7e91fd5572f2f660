"""State layout of :class:`hf_fp8.optim.AdamWFp8` and its DTensor (FSDP2) handling.

A quantized parameter of shape ``[rows, ...]`` is seen as ``[rows, cols]``; each row is cut
into ``Gc = ceil(cols / group_size)`` groups. States are 2-D with the same ``rows``, so a
parameter sharded on dim 0 (FSDP2's ``Shard(0)``) gets states sharded the same way: each
rank owns whole rows, hence whole groups, and ``torch.distributed.checkpoint`` can
reshard them.
"""

from __future__ import annotations

from typing import Any

import torch

QUANT_KEYS = (
    "exp_avg_fp8",
    "exp_avg_scale",
    "exp_avg_exponent",
    "exp_avg_sq_fp8",
    "exp_avg_sq_scale",
    "exp_avg_sq_exponent",
)


MOMENT_FORMATS = ("auto", "log", "fp8")


def resolved_format(group: dict[str, Any]) -> str:
    """``"log"`` or ``"fp8"``: the moment format of a param group.

    ``"auto"`` is ``"log"`` (:mod:`hf_fp8.numerics.log_moments`) unless an option only the fp8
    codes have is set: ``dynamic_range_expansion=False``, ``fp8_format="e5m2"`` or
    ``sqrt_second_moment=True`` (then ``"fp8"``, the COAT / plain FP8 format)."""
    fmt = group.get("moment_format", "fp8")
    if fmt != "auto":
        return fmt
    fp8_only = (
        not group["dynamic_range_expansion"]
        or group["fp8_format"] != "e4m3"
        or group["sqrt_second_moment"]
    )
    return "fp8" if fp8_only else "log"


def _dtensor_cls() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def is_quantized_state(state: dict[str, Any]) -> bool:
    return "exp_avg_fp8" in state


def quantized_states(state: dict[str, Any]) -> tuple[torch.Tensor | None, ...]:
    """``(m_q, m_scale, m_exp, v_q, v_scale, v_exp)``; exponents are ``None`` without expansion."""
    return tuple(state.get(key) for key in QUANT_KEYS)


def row_offset(p: torch.Tensor) -> int:
    """Index of the first row of ``p``'s local shard in the full tensor (0 for plain tensors)."""
    if not is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) if len(offset) else 0


def quantizable_placements(p: torch.Tensor) -> bool:
    """Whether ``p``'s layout keeps whole rows per rank (plain tensor, ``Shard(0)``, ``Replicate``)."""
    if not is_dtensor(p):
        return True
    from torch.distributed.tensor import Replicate, Shard

    return all(
        isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements
    )


def _new(p: torch.Tensor, cols: int, dtype: torch.dtype, fill: float) -> torch.Tensor:
    """A ``[rows, cols]`` state tensor laid out like ``p`` (a DTensor if ``p`` is one)."""
    rows = p.shape[0]
    loc = local(p)
    value = torch.full((loc.shape[0], cols), fill, dtype=torch.float32, device=loc.device)
    value = value.to(dtype)
    if not is_dtensor(p):
        return value
    return _dtensor_cls().from_local(
        value, p.device_mesh, p.placements, run_check=False, shape=(rows, cols), stride=(cols, 1)
    )


def new_quantized_state(
    p: torch.Tensor, *, group_size: int, fp8: torch.dtype, expand: bool, log: bool = False
) -> dict[str, torch.Tensor]:
    """Zero moments with their per-group metadata (``scale = 0``, ``k = 1``).

    ``log`` (``moment_format="log"``): int8 ``exp_avg`` codes (no exponent) and uint8
    ``exp_avg_sq`` codes (with one); ``fp8`` and ``expand`` are ignored."""
    rows = p.shape[0]
    cols = p.numel() // rows
    gc = -(-cols // group_size)
    state = {}
    if log:
        state["exp_avg_fp8"] = _new(p, gc * group_size, torch.int8, 0.0)
        state["exp_avg_scale"] = _new(p, gc, torch.float32, 0.0)
        state["exp_avg_sq_fp8"] = _new(p, gc * group_size, torch.uint8, 0.0)
        state["exp_avg_sq_scale"] = _new(p, gc, torch.float32, 0.0)
        state["exp_avg_sq_exponent"] = _new(p, gc, torch.float32, 1.0)
        return state
    for name in ("exp_avg", "exp_avg_sq"):
        state[f"{name}_fp8"] = _new(p, gc * group_size, fp8, 0.0)
        state[f"{name}_scale"] = _new(p, gc, torch.float32, 0.0)
        if expand:
            state[f"{name}_exponent"] = _new(p, gc, torch.float32, 1.0)
    return state


def new_fp32_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 ``exp_avg`` / ``exp_avg_sq`` shaped like ``p`` (DTensor-aware)."""
    return {
        "exp_avg": torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format),
    }


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes held by the (local) tensors of one parameter's state, ``step`` excluded."""
    return sum(
        local(v).numel() * local(v).element_size()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
