"""DistributedDataParallel (DDP) for models with FP8 layers.

At construction ``DistributedDataParallel(model)`` broadcasts every parameter and buffer from
rank 0, the frozen fp8 codes of ``Fp8Linear`` / ``Fp8Experts`` included. gloo (CPU training,
accelerate's ``MULTI_CPU``) has no float8 type and fails with a bare ``RuntimeError: Invalid
scalar type``; a DDP mixed-precision policy would cast the codes. :func:`ignore_fp8_for_ddp`
takes the fp8 tensors out of DDP's hands (DDP's own ignore list, the documented
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``) and broadcasts them
itself as raw bytes, which every backend carries, so all ranks still start from rank 0's
codes, exactly as DDP would have made them. Call it where you build DDP, on the module you
give DDP, after moving it to its device::

    model.to(device)
    hf_fp8.ignore_fp8_for_ddp(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])

Only tensors of an fp8 dtype are taken out. Everything that can train stays under DDP as
usual: LoRA adapters, biases of FP8 layers, high-precision layers, norms, embeddings; so do
the fp32 weight and activation scales (calibration may change an ``input_scale``; DDP then
broadcasts it at construction as it does any parameter). FP8 codes cannot be trained: a
trainable one is refused with an error that names it.

``accelerate`` users (and the Trainer) need not call it: hf_fp8 applies it inside
``accelerator.prepare`` in DDP mode (the ``accelerate_ddp`` patch,
:mod:`hf_fp8.patches.accelerate_ddp`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

FP8_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)
_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"  # what DDP reads from the module it wraps


def fp8_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers of ``module`` that hold an fp8 dtype, by the names DDP
    compares (``module.named_parameters()`` / ``named_buffers()``)."""
    found = {n: p for n, p in module.named_parameters() if p.dtype in FP8_DTYPES}
    found.update((n, b) for n, b in module.named_buffers() if b.dtype in FP8_DTYPES)
    return found


def check_fp8_frozen(module: nn.Module) -> None:
    """Raise ``ValueError`` naming every fp8 parameter of ``module`` that requires grad."""
    trainable = [
        n for n, p in module.named_parameters() if p.dtype in FP8_DTYPES and p.requires_grad
    ]
    if trainable:
        shown = ", ".join(trainable[:5]) + (
            f" (+{len(trainable) - 5} more)" if len(trainable) > 5 else ""
        )
        raise ValueError(
            f"hf_fp8: {len(trainable)} FP8 parameter(s) require grad: {shown}. FP8 codes cannot "
            "be trained with DistributedDataParallel (or any optimizer): freeze them "
            "(param.requires_grad_(False)) and train LoRA adapters (peft.get_peft_model) or "
            "high-precision layers, or dequantize the model first (model.dequantize())"
        )


def broadcast_fp8_tensors(
    tensors: Iterable[torch.Tensor], process_group: object | None = None
) -> int:
    """Give every rank of ``process_group`` (default: the world) the bytes of ``tensors`` of
    its rank 0, in place, as ``uint8`` (gloo has no fp8 type). Collective: every rank calls it
    with the same tensors in the same order. No-op without an initialized process group or
    with one rank; returns the number of tensors broadcast."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return 0
    src = dist.get_global_rank(group, 0)
    count = 0
    for tensor in tensors:
        data = tensor.detach()
        staged = data if data.is_contiguous() else data.contiguous()
        dist.broadcast(staged.view(torch.uint8), src=src, group=group)
        if staged is not data:
            data.copy_(staged)
        count += 1
    return count


def ignore_fp8_for_ddp(
    module: nn.Module, *, broadcast: bool = True, process_group: object | None = None
) -> list[str]:
    """Have ``DistributedDataParallel(module)`` leave the fp8 tensors of ``module`` alone
    and, with ``broadcast``, give every rank rank 0's fp8 codes here (as DDP's construction
    would). Returns their names (added to DDP's ignore list of ``module``, names already on
    it are kept). Call it right before wrapping ``module``, on its device, on every rank;
    ``process_group`` is the one DDP will use. Calling it again is harmless. Raises
    ``ValueError`` when an fp8 parameter requires grad."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        raise TypeError(
            "hf_fp8.ignore_fp8_for_ddp takes the module before it is wrapped: call it on "
            "model, then DistributedDataParallel(model)"
        )
    check_fp8_frozen(module)
    tensors = fp8_tensors(module)
    if tensors:
        existing = list(module.__dict__.get(_IGNORE_ATTR, ()))  # own, not a wrapped model's
        names = list(dict.fromkeys([*existing, *tensors]))
        set_ignored = getattr(
            DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None
        )
        if set_ignored is not None:
            set_ignored(module, names)
        else:  # the attributes torch's helper sets
            setattr(module, _IGNORE_ATTR, names)
            for tensor in tensors.values():
                tensor._ddp_ignored = True
        if broadcast:
            broadcast_fp8_tensors(tensors.values(), process_group)
    return list(tensors)


__all__ = [
    "FP8_DTYPES",
    "broadcast_fp8_tensors",
    "check_fp8_frozen",
    "fp8_tensors",
    "ignore_fp8_for_ddp",
]
