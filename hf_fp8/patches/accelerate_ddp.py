"""Patch: ``accelerator.prepare(model)`` in DDP mode builds DDP of models with FP8 layers.

accelerate 1.15's ``Accelerator.prepare_model`` (what ``prepare`` and the Trainer call) moves
the model to its device and wraps it in ``torch.nn.parallel.DistributedDataParallel`` when the
distributed type is ``MULTI_CPU`` or a multi-device one (``MULTI_GPU``, ``MULTI_XPU`` …). DDP
broadcasts every parameter at construction, and gloo has no float8 type: ``RuntimeError:
Invalid scalar type``. The patch wraps ``Accelerator.prepare_model``: for a model holding fp8
tensors in those modes (not ``evaluation_mode``, not a model prepared before), it first marks
them for DDP to ignore (:func:`hf_fp8.ddp.ignore_fp8_for_ddp` without its broadcast: the model
may still be on the wrong device for the backend), refusing trainable fp8 parameters; once
accelerate has built DDP it broadcasts the fp8 codes from rank 0 as bytes in DDP's process
group, so every rank holds the same codes, as DDP would have made them. Everything else is
accelerate's own code path; accelerate's other modes (FSDP, DeepSpeed, one process) are not
touched.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

TRIGGER = "accelerate.accelerator"
METHOD = "prepare_model"
MANUAL = (
    "model.to(accelerator.device); hf_fp8.ignore_fp8_for_ddp(model) before "
    "accelerator.prepare(model, ...)"
)


def _ddp_mode(accelerator: Any) -> bool:
    """True when accelerate may wrap models in DDP: MULTI_CPU and the MULTI_<device> types."""
    kind = getattr(accelerator, "distributed_type", None)
    return str(getattr(kind, "value", kind)).startswith("MULTI_")


def _find_ddp(prepared: Any) -> Any:
    """The DDP module inside what ``prepare_model`` returned (maybe torch.compile'd), or None."""
    from torch.nn.parallel import DistributedDataParallel

    for candidate in (prepared, getattr(prepared, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def _wrap(original: Callable, signature: inspect.Signature) -> Callable:
    @functools.wraps(original)
    def prepare_model(self, model, *args, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        from hf_fp8.ddp import broadcast_fp8_tensors, fp8_tensors, ignore_fp8_for_ddp

        try:
            evaluation = signature.bind(self, model, *args, **kwargs).arguments.get(
                "evaluation_mode", False
            )
        except TypeError:  # accelerate's own call raises the right error
            return original(self, model, *args, **kwargs)
        if (
            evaluation
            or getattr(model, "_is_accelerate_prepared", False)
            or isinstance(model, DistributedDataParallel)
            or not _ddp_mode(self)
            or not fp8_tensors(model)
        ):
            return original(self, model, *args, **kwargs)
        ignore_fp8_for_ddp(model, broadcast=False)  # raises on trainable fp8 parameters
        prepared = original(self, model, *args, **kwargs)
        ddp = _find_ddp(prepared)
        if ddp is not None:  # after accelerate moved the model to its device
            group = getattr(ddp, "process_group", None)  # None: the world
            broadcast_fp8_tensors(fp8_tensors(ddp.module).values(), group)
        return prepared

    prepare_model._hf_fp8 = True
    return prepare_model


def applied() -> bool:
    """True when ``Accelerator.prepare_model`` is the wrapped one."""
    module = sys.modules.get(TRIGGER)
    accelerator = getattr(module, "Accelerator", None)
    return bool(getattr(getattr(accelerator, METHOD, None), "_hf_fp8", False))


def apply() -> None:
    """Wrap ``accelerate.Accelerator.prepare_model`` once; raise if its shape changed."""
    module = importlib.import_module(TRIGGER)
    cls = getattr(module, "Accelerator", None)
    current = getattr(cls, METHOD, None)
    if current is None:
        raise RuntimeError(f"{TRIGGER}.Accelerator.{METHOD} is gone")
    if getattr(current, "_hf_fp8", False):
        return
    signature = inspect.signature(current)
    missing = {"self", "model", "evaluation_mode"} - set(signature.parameters)
    if missing:
        raise RuntimeError(f"{TRIGGER}.Accelerator.{METHOD} has no parameter(s) {sorted(missing)}")
    if not hasattr(getattr(module, "DistributedType", None), "MULTI_CPU"):
        raise RuntimeError(f"{TRIGGER}.DistributedType.MULTI_CPU is gone")
    setattr(cls, METHOD, _wrap(current, signature))


TRIGGERS = {TRIGGER: apply}
