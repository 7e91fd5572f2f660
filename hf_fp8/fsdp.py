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
``save_state`` / ``load_state``) through the ``accelerate_fsdp2`` patch. Full optimizer state
dicts (torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
``full_state_dict=True``) fail the same way for ``AdamWFp8``'s fp8 moments:
:func:`full_optimizer_state_dict_fp8` and :func:`set_full_optimizer_state_dict_fp8` (also used
by accelerate's FULL_STATE_DICT optimizer checkpoints through the patch; the full dict also
loads in one process without FSDP).
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


# --------------------------------------------------------------- optimizer state dicts
FULL_OPTIM_FIX = (
    "load an optimizer checkpoint saved from this model with the same trainable parameters "
    "and parameter groups, or resume without the optimizer state to restart the moments"
)


def full_optimizer_state_dict_fp8(
    model: nn.Module, optimizer: torch.optim.Optimizer, options: Any = None
) -> dict[str, Any]:
    """The full (unsharded) optimizer state dict of an FSDP2-sharded model, fp8 states included.

    torch's ``get_optimizer_state_dict(model, optimizer, StateDictOptions(full_state_dict=True))``
    all-gathers every state in its own dtype, and gloo has no float8 type: the fp8 moments of
    :class:`~hf_fp8.optim.AdamWFp8` fail with ``RuntimeError: Invalid scalar type``. This is that
    call with fp8 states gathered as bytes (:func:`full_tensor_fp8`), bit-exact: the same
    dict (parameters named by their fully qualified names, each state tensor whole: the
    per-row groups of ``AdamWFp8`` never straddle a shard). ``options``: torch's
    ``StateDictOptions`` (default ``full_state_dict=True, cpu_offload=True``: only rank 0 gets
    the tensors, on CPU, the other ranks ``{}``, as in torch). Every rank must call it; when
    the states' mesh spans every rank, the ranks first agree that they hold the same state
    entries (else ``RuntimeError``, no gather). Load it with :func:`set_full_optimizer_state_dict_fp8` (on any number of ranks,
    or in one process without FSDP). Like torch's call, an optimizer without state is first
    initialised by a zero-gradient step at ``lr=0`` (weights unchanged)."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    if options is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sharded = get_optimizer_state_dict(
        model,
        optimizer,
        options=dataclasses.replace(
            options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False
        ),
    )
    initialized = dist.is_available() and dist.is_initialized()
    entries = [
        (fqn, key, type(v).__name__, str(getattr(v, "dtype", "")))
        for fqn, st in sharded["state"].items()
        for key, v in st.items()
    ]
    meshes = [
        v.device_mesh
        for st in sharded["state"].values()
        for v in st.values()
        if isinstance(v, DTensor)
    ]
    whole_world = initialized and bool(meshes) and meshes[0].size() == dist.get_world_size()
    if whole_world:  # every rank must gather the same tensors in the same order
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries)
        if any(g != entries for g in gathered):
            raise RuntimeError(
                "full_optimizer_state_dict_fp8: the ranks hold different optimizer state "
                "entries (a rank stepped other parameters); nothing was gathered. Call it on "
                "every rank after the same steps"
            )
    keep = not (options.cpu_offload and initialized) or dist.get_rank() == 0
    state: dict[str, Any] = {}
    for fqn, st in sharded["state"].items():
        entry: dict[str, Any] = {}
        for key, value in st.items():
            if isinstance(value, DTensor):
                value = full_tensor_fp8(value)  # a collective: every rank gathers every tensor
            elif isinstance(value, torch.Tensor):
                value = value.detach().clone()  # not the live state
            if options.cpu_offload and isinstance(value, torch.Tensor):
                value = value.cpu()
            entry[key] = value
        state[fqn] = entry
    if not keep:
        return {}
    import copy

    return {"state": state, "param_groups": copy.deepcopy(sharded["param_groups"])}


def set_full_optimizer_state_dict_fp8(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None,
    options: Any = None,
) -> None:
    """Load a full optimizer state dict (:func:`full_optimizer_state_dict_fp8`, accelerate's
    FULL_STATE_DICT ``optimizer.bin``) into ``optimizer`` over an FSDP2-sharded ``model``, or
    over a plain model in one process.

    torch's ``set_optimizer_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``
    broadcasts in each tensor's dtype (gloo has no float8 type). Here, with
    ``broadcast_from_rank0`` (the default when torch.distributed is initialized), rank 0's
    dict is sent to every rank (fp8 as bytes; the others may pass ``{}`` or ``None``; rank 0
    may pass the exception that kept it from reading the dict, which every rank reports), one
    parameter's state at a time: each rank keeps the rows of its shard of every state laid
    out like its parameter and drops the rest. Then ``optimizer.load_state_dict`` installs
    them. Refused with ``ValueError`` on every rank alike, before any rank changes anything:
    a dict of other parameter names or shapes (another model), for ``AdamWFp8`` one saved
    with other format options (the error names the option to create the optimizer with) or
    holding a damaged tensor (every rank checks the whole tensors); for an optimizer that is
    not ``AdamWFp8``, a dict holding AdamWFp8 state (fp8 codes, ``*_scale`` /
    ``*_exponent`` entries, ``hf_fp8_state_format``: the error names the ``torch_state_dict()``
    conversion); an id-keyed ``optimizer.state_dict()`` (the error says how to load it).
    Whatever fails on rank 0 while it sends the dict (a damaged file, a dict holding other
    objects, quantized or sparse tensors, containers nested deeper than 32 levels) is one
    ``ValueError`` on every rank. Every rank must call it.
    Unlike torch's call, a fresh optimizer takes no initialising step. ``options``: torch's
    ``StateDictOptions`` (``broadcast_from_rank0``; ``strict``, the default, refuses a
    checkpoint without state for a trainable parameter, as torch does, and one without any
    state, unless its param groups record ``step`` 0). A torch ``AdamW`` checkpoint's fp32
    moments become fp8 states under FSDP2 as in one process (each rank converts its rows)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    initialized = dist.is_available() and dist.is_initialized()
    if options is None:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=initialized)
    if options.broadcast_from_rank0 and initialized:
        source = _Rank0Tree(optim_state_dict if dist.get_rank() == 0 else None)
    else:
        source = _LocalTree(optim_state_dict)
    saved_groups = source.get("param_groups")
    saved_state = source.skeleton["state"]  # tensors not received yet
    fqns = _optimizer_fqns(model, optimizer)
    groups = [[fqns[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    _refuse_id_keyed(saved_groups, saved_state)
    merged = getattr(optimizer, "_merged_groups", None)
    if merged is None:  # decided by the dict's content, before anything is installed
        _refuse_fp8_state(saved_groups, saved_state, optimizer)
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"the optimizer checkpoint has {len(saved_groups)} parameter groups, this optimizer "
            f"has {len(groups)} (it was saved from another model or with other parameter "
            f"groups); {FULL_OPTIM_FIX}"
        )
    for i, (saved, names) in enumerate(zip(saved_groups, groups, strict=True)):
        theirs = list(map(str, saved["params"]))
        if sorted(theirs) != sorted(names) or len(set(theirs)) != len(theirs):
            extra = sorted(set(theirs) - set(names))
            lacking = sorted(set(names) - set(theirs))
            raise ValueError(
                f"param group {i} of the optimizer checkpoint names parameters this "
                f"optimizer does not have {extra[:6]} and lacks {lacking[:6]} (it was saved "
                f"from another model, or with other trainable parameters); {FULL_OPTIM_FIX}"
            )
    # AdamWFp8: other format options are named before any shape
    checked_groups = merged(saved_groups) if merged is not None else None
    index = {name: i for i, name in enumerate(n for names in groups for n in names)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = sorted(str(k) for k in saved_state if k not in index)
    if unknown:
        raise ValueError(
            f"the optimizer checkpoint holds state for {unknown[:6]}, which this optimizer's "
            f"param groups do not list (it was saved from another model); {FULL_OPTIM_FIX}"
        )
    if options.strict:
        lacking = [
            n
            for n, p in zip(index, params, strict=True)
            if p.requires_grad and n not in saved_state
        ]
        if lacking and not saved_state and _never_stepped(saved_groups):
            lacking = []  # the state of an optimizer that never stepped: legitimately empty
        if lacking and not saved_state:
            raise ValueError(
                f"the optimizer checkpoint holds no state for any of its {len(index)} "
                "parameters (it lost every parameter's state: a full optimizer state dict "
                "saved after a step, by full_optimizer_state_dict_fp8 or torch's "
                "get_optimizer_state_dict, holds state for every trainable parameter; torch's "
                "strict loading refuses it: every moment would restart); load it with "
                "StateDictOptions(full_state_dict=True, strict=False) to restart them, or "
                f"{FULL_OPTIM_FIX}"
            )
        if lacking:
            raise ValueError(
                f"the optimizer checkpoint has no state for {lacking[:6]} (torch's strict "
                "loading refuses it: those moments would restart); load it with "
                "StateDictOptions(full_state_dict=True, strict=False) to restart them, or "
                f"{FULL_OPTIM_FIX}"
            )
    group_of = [i for i, names in enumerate(groups) for _ in names]
    sharded = any(_is_dtensor(p) for p in params)
    state: dict[int, Any] = {}
    for name in list(saved_state):
        p = params[index[name]]
        st = source.get("state", name)  # this parameter's tensors, whole, on every rank
        if not isinstance(st, dict):
            raise ValueError(
                f"the optimizer checkpoint's state of {name!r} is a {type(st).__name__}, "
                "expected a dict"
            )
        if checked_groups is not None and sharded:
            # every rank checks the whole tensors (load_state_dict sees only its rows): a
            # damaged row is refused on every rank alike, before any rank installs anything
            _check_whole(st, p, checked_groups[group_of[index[name]]], index[name], name)
        state[index[name]] = {k: _shard_like(v, p, name, k) for k, v in st.items()}
    start = 0
    id_groups = []
    for saved, names in zip(saved_groups, groups, strict=True):
        id_groups.append({**saved, "params": list(range(start, start + len(names)))})
        start += len(names)
    _load_checked(optimizer, {"state": state, "param_groups": id_groups}, groups)


def _never_stepped(saved_groups: list[Any]) -> bool:
    """True when the saved param groups record a step and it is 0 in every group (an
    optimizer that never stepped has no state); torch's AdamW records none: False."""
    steps = [g.get("step") for g in saved_groups if isinstance(g, dict)]
    return bool(steps) and all(
        isinstance(s, (int, float)) and not isinstance(s, bool) and s == 0 for s in steps
    )


def _refuse_id_keyed(saved_groups: list[Any], saved_state: dict[Any, Any]) -> None:
    """A plain ``optimizer.state_dict()`` (parameters numbered, not named) is no full
    optimizer state dict: say so and how to load it."""
    ids = [p for g in saved_groups for p in g["params"]]
    if (
        ids
        and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        and all(isinstance(k, int) for k in saved_state)
    ):
        raise ValueError(
            "the optimizer checkpoint is an id-keyed state dict (optimizer.state_dict(), "
            "parameters numbered 0, 1, ..., as saved without FSDP), not a full optimizer state "
            "dict keyed by parameter names; load it in one process without FSDP with "
            "optimizer.load_state_dict(...), or save a name-keyed one with "
            "hf_fp8.fsdp.full_optimizer_state_dict_fp8(model, optimizer) (or torch's "
            "get_optimizer_state_dict(model, optimizer, StateDictOptions(full_state_dict=True)))"
        )


# entries only AdamWFp8's quantized states hold
_FP8_STATE_SUFFIXES = ("_fp8", "_scale", "_exponent")


def _fp8_state_reason(saved_groups: list[Any], saved_state: dict[Any, Any]) -> str | None:
    """Why the dict holds AdamWFp8 (fp8 / quantized) state, from its content; else None."""
    from hf_fp8.optim.adamw_fp8 import STATE_FORMAT_KEY

    if any(isinstance(g, dict) and STATE_FORMAT_KEY in g for g in saved_groups):
        return f"its param groups record {STATE_FORMAT_KEY}"
    for name, st in saved_state.items():
        if not isinstance(st, dict):
            continue
        for key, value in st.items():
            if isinstance(key, str) and key.endswith(_FP8_STATE_SUFFIXES):
                return f"the state of {name!r} holds {key!r}"
            dtype = value[1] if isinstance(value, _TensorSpec) else getattr(value, "dtype", None)
            dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
            if isinstance(dtype, torch.dtype) and _fp8_dtype(dtype):
                return f"the state of {name!r} holds {key!r} as {dtype} codes"
    return None


def _holds_fp8_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(
        isinstance(v, torch.Tensor) and _fp8_dtype(v.dtype)
        for st in getattr(optimizer, "state", {}).values()
        if isinstance(st, dict)
        for v in st.values()
    )


def _refuse_fp8_state(
    saved_groups: list[Any], saved_state: dict[Any, Any], optimizer: torch.optim.Optimizer
) -> None:
    reason = _fp8_state_reason(saved_groups, saved_state)
    if reason is None or _holds_fp8_state(optimizer):  # an fp8 optimizer of another kind
        return
    raise ValueError(
        f"the optimizer checkpoint holds hf_fp8.AdamWFp8 state ({reason}: fp8 moment codes with "
        f"their scales), which this {type(optimizer).__name__} cannot use (it would read the "
        "codes as unscaled moments); nothing was loaded. Resume with hf_fp8.AdamWFp8 and the "
        "options it was saved with (Trainer: optim='adamw_fp8'), or convert it in one process: "
        "load it into an AdamWFp8 with set_full_optimizer_state_dict_fp8 and save "
        "AdamWFp8.torch_state_dict() (fp32 moments torch.optim.AdamW loads)"
    )


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _check_whole(st: dict[str, Any], p: torch.Tensor, group: dict, pid: int, name: str) -> None:
    """AdamWFp8's checks of one parameter's full (unsharded) state, naming its FQN."""
    from hf_fp8.optim._state_check import OptimizerStateError, validated_state

    try:
        validated_state(st, p, group, pid)
    except OptimizerStateError as exc:
        raise ValueError(
            f"the optimizer checkpoint's state of {name!r} does not fit this model's parameter "
            f"of shape {tuple(p.shape)} (a checkpoint of another model) or is damaged: {exc}"
        ) from exc


def _load_checked(optimizer: Any, sd: dict[str, Any], groups: list[list[str]]) -> None:
    """``optimizer.load_state_dict(sd)``; an AdamWFp8 state error names the parameter's FQN."""
    import re

    from hf_fp8.optim._state_check import OptimizerStateError

    names = [n for g in groups for n in g]
    try:
        optimizer.load_state_dict(sd)
    except OptimizerStateError as exc:
        found = re.match(r"optimizer state of parameter (\d+)", str(exc))
        which = names[int(found.group(1))] if found and int(found.group(1)) < len(names) else "?"
        raise ValueError(
            f"the optimizer checkpoint's state of {which!r} does not fit this model's parameter "
            f"or is damaged: {exc}"
        ) from exc


def _check_full_optim_structure(sd: Any) -> None:
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("state"), dict)
        or not isinstance(sd.get("param_groups"), list)
        or not all(
            isinstance(g, dict) and isinstance(g.get("params"), (list, tuple))
            for g in sd["param_groups"]
        )
    ):
        what = "an empty dict" if sd == {} else f"a {type(sd).__name__}"
        raise ValueError(
            f"not a full optimizer state dict ({what}; expected a dict with 'state' keyed by "
            "parameter names and 'param_groups' listing them, as full_optimizer_state_dict_fp8 "
            "returns and accelerate's FULL_STATE_DICT optimizer.bin holds)"
        )


def _optimizer_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(parameter) -> its name in torch's optimizer state dicts (``named_parameters``, with
    torch's wrapper prefixes removed); raises for an optimizer parameter the model lacks."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # pragma: no cover - older / newer torch
        _get_fqns = None
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name) if _get_fqns is not None else {name}
        out.setdefault(id(p), next(iter(fqns)) if len(fqns) == 1 else name)
    missing = [
        i
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        if id(p) not in out
    ]
    if missing:
        raise ValueError(
            f"optimizer parameters {missing[:6]} are not parameters of the model given; pass "
            "the model the optimizer was built over"
        )
    return out


def _shard_like(value: Any, p: torch.Tensor, name: str, key: str) -> Any:
    """A full state tensor of parameter ``p`` cut to this rank's shard, laid out like ``p``
    (states shaped like ``p``, or ``AdamWFp8``'s ``[rows, n]`` states of a parameter sharded
    on rows); scalars and plain parameters' states stay as they are."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if not isinstance(value, torch.Tensor) or not isinstance(p, DTensor) or value.dim() == 0:
        return value
    rows_only = all(
        isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements
    )
    fits = tuple(value.shape) == tuple(p.shape) or (
        rows_only and value.dim() >= 1 and p.dim() >= 1 and value.shape[0] == p.shape[0]
    )
    if not fits:
        raise ValueError(
            f"the optimizer checkpoint's state[{key!r}] of parameter {name!r} has shape "
            f"{tuple(value.shape)}, which does not fit the parameter of shape {tuple(p.shape)} "
            f"(it was saved from another model); {FULL_OPTIM_FIX}"
        )
    # every rank holds the full tensor: each keeps its rows, no communication
    full = value.detach().to(p.device_mesh.device_type).contiguous()
    out = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    home = p.to_local().device  # CPU with FSDP2's CPUOffloadPolicy: the state lives there too
    if out.to_local().device != home:
        out = DTensor.from_local(
            out.to_local().to(home),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=out.shape,
            stride=out.stride(),
        )
    return out


MAX_DEPTH = 32  # containers in an optimizer state dict: state / name / key, groups / list
_SENDABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}  # fmt: skip


def _check_plain_tensor(x: torch.Tensor) -> None:
    """A tensor rank 0 can send as bytes: plain, dense, strided, of a plain dtype, with data
    (a quantized / sparse / nested / meta tensor or a subclass is no optimizer state)."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"holds a {type(x).__name__} (a tensor subclass)")
    if x.is_quantized or x.layout != torch.strided or x.is_nested:
        raise ValueError(f"holds a tensor of dtype {x.dtype} and layout {x.layout}")
    if x.dtype not in _SENDABLE:
        raise ValueError(f"holds a tensor of dtype {x.dtype}, no optimizer state's dtype")
    if x.device.type == "meta":
        raise ValueError("holds a meta tensor (no data)")


class _TensorSpec(tuple):
    """(dtype name, shape) of a tensor that :class:`_Rank0Tree` sends when it is asked for."""


class _LocalTree:
    """A full optimizer state dict this rank holds itself (no broadcast)."""

    def __init__(self, tree: Any) -> None:
        _check_full_optim_structure(tree)
        self.skeleton = tree

    def get(self, *path: Any) -> Any:
        node = self.skeleton
        for key in path:
            node = node[key]
        return node


class _Rank0Tree:
    """Rank 0's full optimizer state dict on every rank: its structure (tensors as
    :class:`_TensorSpec`) broadcast at once, each tensor's bytes (fp8 included) when
    :meth:`get` asks for the branch holding it. Every rank must ask for the same branches
    in the same order (a branch is sent once). A dict rank 0 cannot send raises the same
    ``ValueError`` on every rank."""

    def __init__(self, tree: Any) -> None:
        import torch.distributed as dist

        self.rank0 = dist.get_rank() == 0
        self.tensors: dict[int, torch.Tensor] = {}
        payload: list[Any] = [None]
        if self.rank0:
            try:
                if isinstance(tree, ValueError):  # rank 0 could not read it: all raise
                    raise tree
                if isinstance(tree, BaseException):
                    raise ValueError(f"could not be read ({tree!r})")
                _check_full_optim_structure(tree)
                # param groups first: they are asked for before the state
                payload[0] = (
                    "ok",
                    self._strip({"param_groups": tree["param_groups"], "state": tree["state"]}),
                )
            except Exception as exc:  # any failure reaches every rank: none waits
                self.tensors.clear()
                text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                payload[0] = ("error", text[:2000])
        dist.broadcast_object_list(payload, src=0)
        status, self.skeleton = payload[0]
        if status != "ok":
            raise ValueError(
                f"set_full_optimizer_state_dict_fp8: rank 0's state dict: {self.skeleton}"
            )
        self.device = _comm_device(())

    def _strip(self, x: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:  # no optimizer state dict nests this deep (no RecursionError)
            raise ValueError(f"holds containers nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, torch.Tensor):
            _check_plain_tensor(x)
            self.tensors[len(self.tensors)] = x.detach()
            dtype = str(x.dtype).removeprefix("torch.")
            return _TensorSpec((len(self.tensors) - 1, dtype, tuple(x.shape)))
        if isinstance(x, dict):
            if not all(k is None or isinstance(k, (bool, int, float, str)) for k in x):
                raise ValueError("holds a dict with keys that are not numbers or strings")
            return {k: self._strip(v, depth + 1) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            kind = tuple if type(x) is tuple else list
            return kind(self._strip(v, depth + 1) for v in x)
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise ValueError(f"holds a {type(x).__name__}")

    def get(self, *path: Any) -> Any:
        node = self.skeleton
        for key in path:
            node = node[key]
        return self._receive(node)

    def _receive(self, x: Any) -> Any:
        import torch.distributed as dist

        if isinstance(x, _TensorSpec):
            i, dtype_name, shape = x
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"set_full_optimizer_state_dict_fp8: unknown dtype {dtype_name!r}")
            if self.rank0:
                data = self.tensors.pop(i).to(self.device).contiguous().reshape(-1)
                data = data.view(torch.uint8)
            else:
                numel = 1
                for n in shape:
                    numel *= n
                data = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=self.device)
            dist.broadcast(data, src=0)
            return data.view(dtype).reshape(shape)
        if isinstance(x, dict):
            return {k: self._receive(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self._receive(v) for v in x)
        return x
