"""Patch: ``accelerator.prepare`` under FSDP2 keeps FP8 codes fp8 when mixed precision casts.

``Accelerator(mixed_precision="bf16")`` with ``fsdp_version: 2`` gives every FSDP2 group it
builds (decoder layers, embeddings, the root) ``MixedPrecisionPolicy(param_dtype=bfloat16)``.
FSDP2 would then cast the fp8 codes of ``Fp8Linear`` / ``Fp8Experts`` to bf16 at every
all-gather: twice the bytes, ``Fp8Linear`` computing from bf16 copies, ``Fp8Experts``
refusing them. accelerate 1.15's ``fsdp2_prepare_model`` (``accelerate/utils/fsdp_utils.py``)
upcasts the trainable parameters, optionally moves the model to meta, then asks
``fsdp2_prepare_auto_wrap_policy`` for the wrap policy and calls ``fully_shard`` bottom-up,
skipping modules that already are FSDP2 groups. The patch wraps both names: when the model
holds FP8 modules and the policy casts parameters, :func:`hf_fp8.fully_shard_fp8` shards each
FP8 module first, in its own group that keeps the stored dtypes, right where accelerate
starts sharding, with accelerate's mesh, reshard, offload and ignored-parameter settings and
the policy's ``reduce_dtype``. Everything else is accelerate's own code path.

If accelerate never reaches that point (its internals changed) the wrapper raises instead of
letting training run on cast codes; the error names the manual route.

``Accelerator.get_state_dict`` (what ``accelerator.save_model`` and ``Trainer.save_model``
call) gathers an FSDP2 model with torch's ``get_model_state_dict(full_state_dict=True)``,
which all-gathers fp8 codes in their own dtype: gloo has no float8 type (``RuntimeError:
Invalid scalar type``). The patch wraps it too: for an FSDP2 model holding fp8 tensors it
returns :func:`hf_fp8.fsdp.full_state_dict_fp8` with accelerate's options (codes gathered as
bytes, bit-exact); every other case is accelerate's own code. ``save_fsdp_model`` (what
``accelerator.save_state`` and the Trainer's checkpoints call) goes through accelerate's
``_get_model_state_dict``, wrapped the same way when its options ask for a full state dict;
``load_fsdp_model`` goes through ``_set_model_state_dict``, wrapped with
:func:`hf_fp8.fsdp.set_full_state_dict_fp8` (rank 0's tensors broadcast, fp8 as bytes).

FULL_STATE_DICT optimizer checkpoints (``save_fsdp_optimizer`` / ``load_fsdp_optimizer``, what
``save_state`` / ``load_state`` and the Trainer's checkpoints call) of an ``AdamWFp8`` (or any
optimizer holding fp8 DTensor state) go through :func:`hf_fp8.fsdp.full_optimizer_state_dict_fp8`
and :func:`hf_fp8.fsdp.set_full_optimizer_state_dict_fp8` (torch's ``get_optimizer_state_dict``
/ ``set_optimizer_state_dict`` gather and broadcast the fp8 moments in their own dtype:
``Invalid scalar type`` over gloo). Same file (``optimizer.bin``, parameters by name) and the
plugin's options (``offload_to_cpu``, ``rank0_only``); rank 0 writes it through a hidden file
renamed into place, so a failed write leaves the previous file whole (the next save removes
the hidden files of writes that were killed). A checkpoint of other optimizer options or of
another model is refused on every rank before anything changes. The FULL_STATE_DICT load of
any optimizer reads ``optimizer.bin`` through :func:`_read_optimizer_file` (a symlink out of
the checkpoint folder, a missing, empty, truncated or non-tensor file: one error naming the
file on every rank); an optimizer that is not ``AdamWFp8`` then refuses a file holding
AdamWFp8 state (torch would broadcast its fp8 codes: ``Invalid scalar type``) and loads any
other with accelerate's own ``set_optimizer_state_dict``.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

TRIGGER = "accelerate.accelerator"
UTILS = "accelerate.utils.fsdp_utils"
PREPARE = "fsdp2_prepare_model"
POLICY = "fsdp2_prepare_auto_wrap_policy"
STATE_DICT = "get_state_dict"
SAVE_STATE_DICT = "_get_model_state_dict"  # accelerate 1.16: what save_fsdp_model calls
LOAD_STATE_DICT = "_set_model_state_dict"  # and what load_fsdp_model calls
OPTIM_SAVE = "save_fsdp_optimizer"
OPTIM_LOAD = "load_fsdp_optimizer"
MANUAL = (
    "call hf_fp8.fully_shard_fp8(model) before accelerator.prepare(model, optimizer, ...), "
    'or use mixed_precision="no"'
)

_PENDING = threading.local()  # .kwargs: fully_shard_fp8 arguments waiting for the policy call


def _casting_policy(plugin: Any) -> Any:
    """The FSDP2 ``MixedPrecisionPolicy`` of ``plugin`` when it casts parameters, else None."""
    policy = getattr(plugin, "mixed_precision_policy", None)
    return policy if getattr(policy, "param_dtype", None) is not None else None


def _shard_kwargs(accelerator: Any, model: Any, plugin: Any, policy: Any) -> dict[str, Any]:
    """``fully_shard_fp8`` arguments matching the ``fully_shard`` calls accelerate makes."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": plugin.reshard_after_forward,
        "reduce_dtype": policy.reduce_dtype,
    }
    if plugin.cpu_offload is not None:
        kwargs["offload_policy"] = plugin.cpu_offload
    if getattr(plugin, "ignored_modules", None) is not None:
        from accelerate.utils.fsdp_utils import get_parameters_from_modules

        kwargs["ignored_params"] = get_parameters_from_modules(
            plugin.ignored_modules, model, accelerator.device
        )
    return kwargs


def _wrap_prepare(original: Callable) -> Callable:
    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator, model, *args, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        from hf_fp8.fsdp import fp8_modules

        plugin = accelerator.state.fsdp_plugin
        policy = _casting_policy(plugin)
        inner = getattr(model, "_orig_mod", model)  # torch.compile'd
        modules = [] if policy is None or isinstance(inner, FSDPModule) else fp8_modules(inner)
        if not [m for m in modules if not isinstance(m, FSDPModule)]:
            return original(accelerator, model, *args, **kwargs)
        _PENDING.kwargs = _shard_kwargs(accelerator, model, plugin, policy)
        try:
            prepared = original(accelerator, model, *args, **kwargs)
        finally:
            missed = getattr(_PENDING, "kwargs", None) is not None
            _PENDING.kwargs = None
        if missed:
            raise RuntimeError(
                f"hf_fp8: accelerate's FSDP2 preparation never called {POLICY} (accelerate's "
                f"internals changed), so {len(modules)} FP8 module(s) were sharded with "
                f"param_dtype={policy.param_dtype} and FSDP2 casts their fp8 codes; instead: "
                f"{MANUAL}"
            )
        return prepared

    fsdp2_prepare_model._hf_fp8 = True
    return fsdp2_prepare_model


def _wrap_policy(original: Callable) -> Callable:
    @functools.wraps(original)
    def fsdp2_prepare_auto_wrap_policy(fsdp2_plugin, model, *args, **kwargs):
        shard_kwargs = getattr(_PENDING, "kwargs", None)
        if shard_kwargs is not None:
            _PENDING.kwargs = None
            from hf_fp8.fsdp import fully_shard_fp8

            fully_shard_fp8(model, **shard_kwargs)
        return original(fsdp2_plugin, model, *args, **kwargs)

    fsdp2_prepare_auto_wrap_policy._hf_fp8 = True
    return fsdp2_prepare_auto_wrap_policy


def _has_fp8_dtensor(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    from hf_fp8.fsdp import _fp8_dtype

    return any(
        isinstance(t, DTensor) and _fp8_dtype(t.dtype)
        for t in [*model.parameters(), *model.buffers()]
    )


def _wrap_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_state_dict(self, model, *args, **kwargs):
        if not getattr(self, "is_fsdp2", False) or not _has_fp8_dtensor(model):
            return original(self, model, *args, **kwargs)
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        from hf_fp8.fsdp import full_state_dict_fp8

        # accelerate 1.16's options for FSDP2 (broadcast_from_rank0 only matters on load)
        options = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True
        )
        return full_state_dict_fp8(model, options)

    get_state_dict._hf_fp8 = True
    return get_state_dict


def _wrap_save_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def _get_model_state_dict(model, adapter_only=False, sd_options=None):
        if (
            sd_options is None
            or not getattr(sd_options, "full_state_dict", False)
            or not _has_fp8_dtensor(model)
        ):
            return original(model, adapter_only=adapter_only, sd_options=sd_options)
        import dataclasses

        from accelerate.utils.modeling import is_peft_model

        from hf_fp8.fsdp import full_state_dict_fp8

        if adapter_only and is_peft_model(model):  # accelerate's adapter-only options
            sd_options = dataclasses.replace(sd_options, ignore_frozen_params=True)
        return full_state_dict_fp8(model, sd_options)

    _get_model_state_dict._hf_fp8 = True
    return _get_model_state_dict


def _wrap_load_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def _set_model_state_dict(model, state_dict, adapter_only=False, sd_options=None):
        if (
            sd_options is None
            or not getattr(sd_options, "full_state_dict", False)
            or not _has_fp8_dtensor(model)
        ):
            return original(model, state_dict, adapter_only=adapter_only, sd_options=sd_options)
        import dataclasses

        from accelerate.utils.modeling import is_peft_model

        from hf_fp8.fsdp import set_full_state_dict_fp8

        if adapter_only and is_peft_model(model):  # accelerate's adapter-only options
            sd_options = dataclasses.replace(sd_options, strict=False)
        return set_full_state_dict_fp8(model, state_dict, sd_options)

    _set_model_state_dict._hf_fp8 = True
    return _set_model_state_dict


def _fp8_optimizer(optimizer: Any) -> bool:
    """True when ``optimizer`` (maybe accelerate's wrapper) is an ``AdamWFp8`` or holds fp8
    DTensor state: its FULL_STATE_DICT checkpoints go through hf_fp8.fsdp's full optimizer
    state dicts (fp8 sent as bytes; gloo has no float8 type)."""
    from torch.distributed.tensor import DTensor

    from hf_fp8.fsdp import _fp8_dtype
    from hf_fp8.optim import AdamWFp8

    inner = _unwrapped(optimizer)
    if isinstance(inner, AdamWFp8):
        return True
    return any(
        isinstance(v, DTensor) and _fp8_dtype(v.dtype)
        for state in getattr(inner, "state", {}).values()
        for v in state.values()
    )


def _unwrapped(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` under accelerate's ``AcceleratedOptimizer`` wrappers."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _full_fsdp2(fsdp_plugin: Any) -> bool:
    return getattr(fsdp_plugin, "fsdp_version", 1) == 2 and "FULL_STATE_DICT" in str(
        getattr(fsdp_plugin, "state_dict_type", "")
    )


def _sd_options(fsdp_plugin: Any) -> Any:
    """accelerate 1.16's ``_prepare_sd_options`` for a FULL_STATE_DICT FSDP2 plugin."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    config = fsdp_plugin.state_dict_config
    return StateDictOptions(
        full_state_dict=True,
        cpu_offload=getattr(config, "offload_to_cpu", False),
        broadcast_from_rank0=getattr(config, "rank0_only", False),
    )


def _optimizer_file(output_dir: str, optimizer_index: int) -> str:
    import os

    from accelerate.utils.constants import OPTIMIZER_NAME

    name = (
        f"{OPTIMIZER_NAME}.bin"
        if optimizer_index == 0
        else f"{OPTIMIZER_NAME}_{optimizer_index}.bin"
    )
    return os.path.join(output_dir, name)


PARTIAL_MARKER = ".hf_fp8-partial-"


def _partial_name(name: str) -> str:
    """The hidden file a write of ``name`` goes through: ``.<name>.hf_fp8-partial-<host>-<pid>``."""
    import os
    import socket

    return f".{name}{PARTIAL_MARKER}{socket.gethostname()}-{os.getpid()}"


def _remove_stale_partials(folder: str, name: str) -> None:
    """Remove the hidden files that writes of ``name`` killed before the rename (SIGKILL, OOM,
    preemption) left in ``folder``, by the rules of hf_fp8.serialization.atomic's orphans:
    only this pattern, regular files (no link) of this user, named by a process of this host
    that is gone. (Files named without the host, by earlier versions, only once unchanged for
    as long as atomic's stale folders.) Never fails a save."""
    import os
    import re
    import socket
    import stat
    import time

    from hf_fp8.serialization.atomic import _STALE_AFTER_S
    from hf_fp8.utils.processes import pid_gone

    pattern = re.compile(re.escape(f".{name}{PARTIAL_MARKER}") + r"(?:(?P<host>.+)-)?(?P<pid>\d+)")
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    host = socket.gethostname()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or int(match["pid"]) == os.getpid():
            continue
        if match["host"] is not None and match["host"] != host:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or (uid is not None and info.st_uid != uid):
                continue
            if match["host"] is None and time.time() - info.st_mtime < _STALE_AFTER_S:
                continue
            if not pid_gone(int(match["pid"])):
                continue
            os.unlink(entry.path)
        except OSError:
            continue


def _save_whole(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` through a hidden file beside it, renamed into place: a failed
    or killed write leaves the previous file whole (and no partial file after an error; the
    partial files of killed writes are removed by the next save, :func:`_remove_stale_partials`)."""
    import os

    import torch

    folder, name = os.path.split(path)
    _remove_stale_partials(folder or ".", name)
    partial = os.path.join(folder, _partial_name(name))
    handle = _create_partial(partial)
    try:
        with handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        if os.path.lexists(partial):
            os.unlink(partial)  # the file this call created (exclusively, above)
        raise


def _create_partial(partial: str) -> Any:
    """Open ``partial`` for writing, created by this call: exclusively and without following
    links (the name is predictable, so a link planted there must not redirect the write
    outside the folder). A regular file of this user left under the name (by a dead process
    that had this pid) is replaced; anything else there is refused, naming it."""
    import os
    import stat

    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_CLOEXEC", 0)
    for attempt in range(2):
        try:
            return os.fdopen(os.open(partial, flags, 0o666), "wb")
        except FileExistsError:
            info = os.lstat(partial)
            ours = not hasattr(os, "geteuid") or info.st_uid == os.geteuid()
            if attempt or not (stat.S_ISREG(info.st_mode) and ours):
                raise ValueError(
                    f"{partial} exists and is not a file hf_fp8 left (a link, a folder or "
                    "another user's file): hf_fp8 writes the optimizer file through this name; "
                    "remove it and save again"
                ) from None
            os.unlink(partial)
    raise AssertionError("unreachable")


def _wrap_optim_save(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_fsdp_optimizer(
        fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, *args, **kw
    ):
        if not (_full_fsdp2(fsdp_plugin) and _fp8_optimizer(optimizer)):
            return original(
                fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index, *args, **kw
            )
        import os

        from hf_fp8.fsdp import full_optimizer_state_dict_fp8

        os.makedirs(output_dir, exist_ok=True)
        # every rank gathers (fp8 as bytes); rank 0 writes the file whole, as accelerate names it
        state = full_optimizer_state_dict_fp8(
            model, _unwrapped(optimizer), _sd_options(fsdp_plugin)
        )
        if accelerator.process_index == 0:
            _save_whole(state, _optimizer_file(output_dir, optimizer_index))

    save_fsdp_optimizer._hf_fp8 = True
    return save_fsdp_optimizer


def _read_optimizer_file(folder: str, file: str) -> Any:
    """``torch.load(file, weights_only=True)`` of an optimizer file inside ``folder``; every
    failure is a ``ValueError`` naming the file, what is wrong and the fix (never the advice
    to load it with ``weights_only=False``): a symlink leaving the folder (DESIGN §8), a
    missing, empty, truncated or damaged file, a file holding objects other than tensors."""
    import os
    import pickle

    import torch

    from hf_fp8.optim._state_check import RESTART_FIX
    from hf_fp8.utils.folders import UnsafePathError, contained

    try:
        contained(folder, os.path.basename(file), links_within=folder)
    except UnsafePathError as exc:
        raise ValueError(
            f"{file}: refused (hf_fp8 reads no optimizer state from outside the checkpoint "
            f"folder): {exc}"
        ) from None
    fix = f"re-save the checkpoint, or {RESTART_FIX}"
    if not os.path.lexists(file):
        raise FileNotFoundError(2, f"No such file or directory; {fix}", file)
    try:
        size = os.path.getsize(file)
    except OSError as exc:
        raise ValueError(f"{file} cannot be read ({type(exc).__name__}: {exc}); {fix}") from None
    if size == 0:
        raise ValueError(f"{file} is empty (a write that never finished); {fix}")
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's reason, without its advice (weights_only=False, allowlisting the global)
        body = str(exc).split("Check the documentation")[0]
        reasons = [
            " ".join(part.split()).split(" was not an allowed global")[0]
            for part in body.split("\n\n")
            if part.strip()
        ]
        reasons = [
            r
            for r in reasons
            if not any(w in r for w in ("weights_only", "safe_globals", "trusted source"))
        ]
        why = reasons[0][:300] if reasons else "it holds objects other than tensors and numbers"
        raise ValueError(
            f"{file} is not an optimizer state dict torch or hf_fp8 writes: torch.load("
            f"weights_only=True) refused it ({why}); it was not loaded. Replace it with the "
            f"optimizer.bin of a trusted checkpoint, or {RESTART_FIX}"
        ) from None
    except (EOFError, RuntimeError, OSError) as exc:
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise ValueError(
            f"{file} is truncated or damaged ({type(exc).__name__}: {first}); {fix}"
        ) from None
    except Exception as exc:  # anything else torch.load raises: still named, still a ValueError
        raise ValueError(
            f"{file} could not be read ({type(exc).__name__}: {str(exc)[:300]}); {fix}"
        ) from None


def _load_plain(
    model: Any, optimizer: Any, state: Any, options: Any, file: str, from_rank0: bool
) -> None:
    """accelerate's FULL_STATE_DICT load for an optimizer that is not ``AdamWFp8``
    (``set_optimizer_state_dict``), after every rank has learnt that rank 0 read the file
    and that it holds no AdamWFp8 state (which torch would broadcast as float8:
    ``Invalid scalar type``, or install as unscaled moments)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from hf_fp8.fsdp import _check_full_optim_structure, _refuse_fp8_state

    verdict: list[Any] = [None]
    if isinstance(state, BaseException):
        verdict[0] = str(state) if isinstance(state, ValueError) else f"{state!r}"
    elif state is not None:
        try:
            _check_full_optim_structure(state)
            _refuse_fp8_state(state["param_groups"], state["state"], optimizer)
        except ValueError as exc:
            verdict[0] = f"{file}: {exc}"
        except Exception as exc:  # any failure reaches every rank
            verdict[0] = f"{file}: {type(exc).__name__}: {str(exc)[:300]}"
    if from_rank0:
        dist.broadcast_object_list(verdict, src=0)
    if isinstance(state, BaseException):
        raise state  # rank 0: its own reading error
    if verdict[0] is not None:
        raise ValueError(verdict[0])
    set_optimizer_state_dict(model, optimizer, state, options=options)


def _wrap_optim_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_fsdp_optimizer(
        fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0, *args, **kw
    ):
        if not _full_fsdp2(fsdp_plugin):
            return original(
                fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index, *args, **kw
            )
        import torch.distributed as dist

        from hf_fp8.fsdp import set_full_optimizer_state_dict_fp8

        accelerator.wait_for_everyone()
        options = _sd_options(fsdp_plugin)
        file = _optimizer_file(input_dir, optimizer_index)
        state = None
        reads = accelerator.process_index == 0 or not fsdp_plugin.optim_state_dict_config.rank0_only
        from_rank0 = options.broadcast_from_rank0 and dist.is_available() and dist.is_initialized()
        if reads:
            try:
                state = _read_optimizer_file(input_dir, file)
            except Exception as exc:
                if not isinstance(exc, (ValueError, FileNotFoundError)):
                    exc = ValueError(f"{file} could not be read ({type(exc).__name__}: {exc})")
                if not from_rank0:
                    raise exc from None
                state = exc  # sent to the other ranks, which raise it too: no rank hangs
        inner = _unwrapped(optimizer)
        if not _fp8_optimizer(optimizer):
            # another optimizer: accelerate's own load (torch's set_optimizer_state_dict), once
            # the file is read (errors name it) and found to hold no AdamWFp8 state, on every rank
            _load_plain(model, inner, state, options, file, from_rank0)
            accelerator.wait_for_everyone()
            return None
        try:
            set_full_optimizer_state_dict_fp8(model, inner, state, options)
        except ValueError as exc:
            if isinstance(state, BaseException):
                raise state from None  # rank 0: its reading error, the file named
            if file in str(exc):
                raise
            raise ValueError(f"{file}: {exc}") from exc
        accelerator.wait_for_everyone()

    load_fsdp_optimizer._hf_fp8 = True
    return load_fsdp_optimizer


def applied() -> bool:
    """True when ``accelerator.prepare`` goes through the wrapped FSDP2 preparation."""
    accelerator = sys.modules.get(TRIGGER)
    return bool(getattr(getattr(accelerator, PREPARE, None), "_hf_fp8", False))


def apply() -> None:
    """Wrap accelerate's FSDP2 preparation once (in every module that holds the name)."""
    import importlib

    utils = importlib.import_module(UTILS)
    accelerator = importlib.import_module(TRIGGER)
    prepare = getattr(utils, PREPARE)
    if getattr(prepare, "_hf_fp8", False):
        return
    if not getattr(getattr(accelerator, PREPARE, None), "__name__", "") == PREPARE:
        raise RuntimeError(f"accelerate.accelerator no longer imports {PREPARE}")
    policy = getattr(utils, POLICY, None)
    _apply_state_dict(accelerator)
    _apply_save_state_dict(utils)
    wrapped = _wrap_prepare(prepare)
    for module in (utils, accelerator, sys.modules.get("accelerate.utils")):
        if module is not None and getattr(module, PREPARE, None) is prepare:
            setattr(module, PREPARE, wrapped)
    if policy is None:  # the wrapper then refuses the casting case with the manual route
        from hf_fp8.patches import disable

        disable("accelerate_fsdp2", f"{UTILS}.{POLICY} is gone", partly=True)
        return
    setattr(utils, POLICY, _wrap_policy(policy))


def _apply_state_dict(accelerator: Any) -> None:
    """Wrap ``Accelerator.get_state_dict`` once; if it is gone, only that part is disabled."""
    cls = getattr(accelerator, "Accelerator", None)
    current = getattr(cls, STATE_DICT, None)
    if current is None:
        from hf_fp8.patches import disable

        disable("accelerate_fsdp2", f"{TRIGGER}.Accelerator.{STATE_DICT} is gone", partly=True)
        return
    if not getattr(current, "_hf_fp8", False):
        setattr(cls, STATE_DICT, _wrap_state_dict(current))


def _apply_save_state_dict(utils: Any) -> None:
    """Wrap ``accelerate.utils.fsdp_utils._get_model_state_dict`` and ``_set_model_state_dict``
    once (each partly disabled if gone or changed: ``save_fsdp_model`` / ``load_fsdp_model``
    with FULL_STATE_DICT then fail over gloo as before)."""
    import inspect

    from hf_fp8.patches import disable

    wanted = {
        SAVE_STATE_DICT: (["model", "adapter_only", "sd_options"], _wrap_save_state_dict),
        LOAD_STATE_DICT: (
            ["model", "state_dict", "adapter_only", "sd_options"],
            _wrap_load_state_dict,
        ),
    }
    for name, (parameters, wrap) in wanted.items():
        current = getattr(utils, name, None)
        if current is None:
            disable("accelerate_fsdp2", f"{UTILS}.{name} is gone", partly=True)
        elif getattr(current, "_hf_fp8", False):
            continue
        elif list(inspect.signature(current).parameters) != parameters:
            disable("accelerate_fsdp2", f"{UTILS}.{name} changed its arguments", partly=True)
        else:
            setattr(utils, name, wrap(current))
    for name, wrap in ((OPTIM_SAVE, _wrap_optim_save), (OPTIM_LOAD, _wrap_optim_load)):
        current = getattr(utils, name, None)
        if current is None:
            disable("accelerate_fsdp2", f"{UTILS}.{name} is gone", partly=True)
        elif not getattr(current, "_hf_fp8", False):
            wrapped = wrap(current)
            holders = ("accelerate.utils", "accelerate.accelerator", "transformers.trainer")
            for module in (utils, *(sys.modules.get(m) for m in holders)):
                if module is not None and getattr(module, name, None) is current:
                    setattr(module, name, wrapped)


TRIGGERS = {TRIGGER: apply}
