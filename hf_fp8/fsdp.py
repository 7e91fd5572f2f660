"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models with FP8 layers.

FP8 codes and their scales are frozen parameters: FSDP2 shards them like any other (the
expert dimension of ``Fp8Experts`` on dim 0, ``Fp8Linear`` rows) and a training step leaves
them bit-identical; the high-precision parts (norms, routers, embeddings, LoRA adapters,
experts kept in high precision) train with any optimizer, ``AdamWFp8`` included. One thing
breaks: a ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` on a group holding FP8
modules casts their fp8 codes to bf16 at every all-gather (twice the bytes; ``Fp8Experts``
refuses the cast weights). :func:`fully_shard_fp8` shards every FP8 module in a group of its
own that keeps the stored dtypes; shard the layers and the model after it as usual::

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard_fp8(model, mesh=mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)

Full (unsharded) state dicts: torch's ``get_model_state_dict`` / ``set_model_state_dict``
with ``full_state_dict=True`` move every tensor in its own dtype, and gloo has no float8
type (``RuntimeError: Invalid scalar type``). :func:`full_state_dict_fp8` and
:func:`set_full_state_dict_fp8` are those calls with fp8 codes sent as bytes (bit-exact);
``accelerate`` uses them for FP8 models (``get_state_dict``, ``save_model``, FULL_STATE_DICT
``save_state`` / ``load_state``) through the ``accelerate_fsdp2`` patch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import Fp8Linear


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """Every ``Fp8Linear`` / ``Fp8Experts`` of ``model`` (once each), in module order."""
    return [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))]


def fully_shard_fp8(
    model: nn.Module, *, reduce_dtype: torch.dtype | None = torch.float32, **fsdp_kwargs: Any
) -> list[nn.Module]:
    """``fully_shard`` each FP8 module of ``model`` in its own FSDP2 group whose
    ``MixedPrecisionPolicy`` keeps the stored dtypes (``param_dtype=None``: fp8 codes stay
    fp8, scales fp32) and leaves the inputs as they come (``cast_forward_inputs=False``: the
    enclosing group's policy casts them). ``fsdp_kwargs`` (``mesh``, ``reshard_after_forward``
    …) go to ``fully_shard``; an ``mp_policy`` there is refused (that is what this replaces).
    Call it before sharding the enclosing layers; returns the modules it sharded (FP8
    modules that already are FSDP2 groups are left as they are: calling it twice is harmless).

    ``accelerate`` users need not call it: with ``fsdp_version: 2`` and a casting
    ``mixed_precision``, hf_fp8 applies it inside ``accelerator.prepare`` (the
    ``accelerate_fsdp2`` patch, :mod:`hf_fp8.patches.accelerate_fsdp2`)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if "mp_policy" in fsdp_kwargs:
        raise ValueError(
            "fully_shard_fp8 sets its own mp_policy (param_dtype=None keeps the fp8 codes); "
            "give your MixedPrecisionPolicy to the fully_shard calls of the layers and the model"
        )
    keep = MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    modules = [m for m in fp8_modules(model) if not isinstance(m, FSDPModule)]
    for module in modules:
        fully_shard(module, mp_policy=keep, **fsdp_kwargs)
    return modules


def _fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def full_tensor_fp8(tensor: Any) -> torch.Tensor:
    """``tensor.full_tensor()`` of a DTensor (an FSDP2 shard) that also works for fp8 codes
    over backends without a float8 type (gloo: ``RuntimeError: Invalid scalar type``): the
    codes are gathered as their bytes (``view(torch.uint8)``) and viewed back, bit-exact.
    Other dtypes gather as ``full_tensor()`` does; a plain tensor is returned as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device.type != tensor.device_mesh.device_type:  # CPU-offloaded shards
        tensor = tensor.to(tensor.device_mesh.device_type)
    replicate = [Replicate()] * len(tensor.placements)
    if not _fp8_dtype(tensor.dtype):
        return _wait(tensor.redistribute(tensor.device_mesh, replicate).to_local())
    codes = DTensor.from_local(
        tensor.to_local().view(torch.uint8),
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )
    return _wait(codes.redistribute(tensor.device_mesh, replicate).to_local()).view(tensor.dtype)


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def full_state_dict_fp8(model: nn.Module, options: Any = None) -> dict[str, Any]:
    """The full (unsharded) state dict of an FSDP2-sharded model holding FP8 layers.

    torch's ``get_model_state_dict(model, StateDictOptions(full_state_dict=True))`` gathers
    every DTensor with an all-gather in its own dtype, and gloo has no float8 type: it fails
    with ``RuntimeError: Invalid scalar type``. This is that call with fp8 codes gathered as
    bytes (:func:`full_tensor_fp8`), bit-exact. ``options``: torch's ``StateDictOptions``
    (default: ``full_state_dict=True, cpu_offload=True``, what ``accelerator.get_state_dict``
    uses); with ``cpu_offload=True`` (and torch.distributed initialized) only rank 0 gets the
    tensors, on CPU, the other ranks an empty dict, as in torch. Every rank must call it.
    ``accelerator.get_state_dict`` / ``save_model`` and ``Trainer.save_model`` use it for
    models with FP8 layers (the ``accelerate_fsdp2`` patch)."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if options is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sharded = get_model_state_dict(
        model,
        options=dataclasses.replace(
            options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False
        ),
    )
    rank0_only = options.cpu_offload and dist.is_available() and dist.is_initialized()
    keep = not rank0_only or dist.get_rank() == 0
    out: dict[str, Any] = {}
    for key, value in sharded.items():
        value = full_tensor_fp8(value)  # a collective: every rank gathers every tensor
        if keep:
            if options.cpu_offload and isinstance(value, torch.Tensor):
                value = value.cpu()
            out[key] = value
    return out


def set_full_state_dict_fp8(
    model: nn.Module, state_dict: dict[str, Any], options: Any = None
) -> Any:
    """Load a full (unsharded) state dict into an FSDP2-sharded model holding FP8 layers.

    torch's ``set_model_state_dict(model, sd, StateDictOptions(full_state_dict=True,
    broadcast_from_rank0=True))`` broadcasts every tensor in its own dtype: gloo has no
    float8 type (``RuntimeError: Invalid scalar type``). Here fp8 codes travel as bytes.
    With ``broadcast_from_rank0`` (the default when torch.distributed is initialized) only
    rank 0's ``state_dict`` is read (the others may pass ``{}``); every rank must call it.
    Each rank then keeps its own shard; ``strict`` and the other options are torch's.
    Returns what ``set_model_state_dict`` returns (missing and unexpected keys)."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import DTensor, distribute_tensor

    initialized = dist.is_available() and dist.is_initialized()
    if options is None:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=initialized)
    local = dataclasses.replace(
        options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False
    )
    sharded = get_model_state_dict(model, options=local)
    from_rank0 = options.broadcast_from_rank0 and initialized
    keys = [k for k, v in sharded.items() if isinstance(v, torch.Tensor)]
    if from_rank0:
        # rank 0 says which keys it holds with the right shape (1), holds wrong (2), lacks (0)
        status = torch.zeros(len(keys), dtype=torch.uint8)
        if dist.get_rank() == 0:
            for i, key in enumerate(keys):
                if key in state_dict:
                    same = tuple(state_dict[key].shape) == tuple(sharded[key].shape)
                    status[i] = 1 if same else 2
        status = _broadcast(status, _comm_device(sharded.values())).cpu()
        wrong = [k for k, s in zip(keys, status.tolist(), strict=True) if s == 2]
        if wrong:
            raise ValueError(
                f"set_full_state_dict_fp8: rank 0's state dict has other shapes than the model "
                f"for {wrong[:8]}; it is not this model's state dict"
            )
        present = [k for k, s in zip(keys, status.tolist(), strict=True) if s == 1]
    else:
        present = [k for k in keys if k in state_dict]
    out: dict[str, Any] = {}
    for key in present:
        current = sharded[key]
        device = _comm_device([current])
        if from_rank0:
            if dist.get_rank() == 0:
                full = state_dict[key].detach().to(device=device, dtype=current.dtype)
            else:
                full = torch.empty(current.shape, dtype=current.dtype, device=device)
            full = _broadcast(full.contiguous(), device)
        else:
            full = state_dict[key].detach().to(device=device, dtype=current.dtype)
        if isinstance(current, DTensor):
            # every rank holds the full tensor: each keeps its shard, no communication
            full = distribute_tensor(
                full, current.device_mesh, current.placements, src_data_rank=None
            )
        out[key] = full
    return set_model_state_dict(model, out, options=local)


def _comm_device(tensors: Any) -> torch.device:
    """Where a collective's buffers live: the DTensors' mesh device, else CPU for gloo."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for t in tensors:
        if isinstance(t, DTensor):
            return torch.device(t.device_mesh.device_type)
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _broadcast(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``dist.broadcast`` from rank 0 that also carries fp8 (as bytes)."""
    import torch.distributed as dist

    tensor = tensor.to(device)
    data = tensor.view(torch.uint8) if _fp8_dtype(tensor.dtype) else tensor
    dist.broadcast(data, src=0)
    return tensor
