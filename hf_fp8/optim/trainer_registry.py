"""``TrainingArguments(optim="adamw_fp8_coat")`` / ``optim="adamw_fp8"`` for the stock Trainer.

transformers 5.x turns ``optim`` into the enum ``training_args.OptimizerNames`` (in
``TrainingArguments.__post_init__`` and in ``HfArgumentParser``'s ``choices``), then
``Trainer.get_optimizer_cls_and_kwargs`` looks the member up in
``trainer_optimizer._OPTIMIZER_HANDLERS``. A new name therefore needs an enum member and a
handler; :func:`register_trainer_optimizers` adds both (idempotently). These are private
internals: if a future transformers changes them, registration raises a ``RuntimeError``
that points to the public route::

    Trainer(model, args, optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, {"lr": 1e-4, ...}))

``optim_args`` (``"group_size=64,dynamic_range_expansion=False"``) are parsed into
:class:`~hf_fp8.optim.AdamWFp8` keyword arguments (see :data:`OPTIM_ARGS`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

from hf_fp8.optim.adamw_fp8 import AdamWFp8

# optim name -> (enum member name, dynamic_range_expansion)
TRAINER_OPTIMIZERS = {
    "adamw_fp8_coat": ("ADAMW_FP8_COAT", True),
    "adamw_fp8": ("ADAMW_FP8", False),
}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


# optim_args keys accepted by the handler and how their strings are converted.
OPTIM_ARGS: dict[str, Callable[[str], Any]] = {
    "group_size": int,
    "fp8_format": str,
    "dynamic_range_expansion": _parse_bool,
    "min_quantize_numel": int,
    "implementation": str,
}

_PUBLIC_ROUTE = (
    "pass the optimizer explicitly instead: "
    "Trainer(..., optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, {'lr': ..., "
    "'dynamic_range_expansion': True}))"
)


def parse_optim_args(optim_args: dict[str, str]) -> dict[str, Any]:
    """Convert Trainer ``optim_args`` strings into ``AdamWFp8`` keyword arguments."""
    kwargs = {}
    for key, text in optim_args.items():
        if key not in OPTIM_ARGS:
            raise ValueError(
                f"unknown optim_args key {key!r} for adamw_fp8; accepted: {sorted(OPTIM_ARGS)}"
            )
        try:
            kwargs[key] = OPTIM_ARGS[key](text)
        except ValueError as exc:
            raise ValueError(f"optim_args {key}={text!r}: {exc}") from None
    return kwargs


def _handler(expand: bool, ctx: Any) -> tuple[type, dict[str, Any]]:
    """Trainer handler: ``(AdamWFp8, kwargs)`` from an ``OptimizerContext``."""
    try:
        kwargs = {**ctx.optimizer_kwargs, **ctx.adam_kwargs}
        optim_args = ctx.optim_args
    except AttributeError as exc:
        raise RuntimeError(
            f"transformers' OptimizerContext changed ({exc}); {_PUBLIC_ROUTE}"
        ) from exc
    kwargs["dynamic_range_expansion"] = expand
    kwargs.update(parse_optim_args(optim_args or {}))
    return AdamWFp8, kwargs


def _add_enum_member(enum_cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add ``name = value`` to an existing ``str`` enum (no-op when already there)."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    if name in enum_cls.__members__:
        raise RuntimeError(f"{enum_cls.__name__}.{name} already exists with another value")
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


def register_trainer_optimizers() -> None:
    """Make ``optim="adamw_fp8_coat"`` and ``optim="adamw_fp8"`` known to transformers.

    Idempotent. Raises ``RuntimeError`` (naming the public alternative) when transformers'
    ``OptimizerNames`` / ``_OPTIMIZER_HANDLERS`` are missing or behave differently.
    """
    try:
        from transformers import trainer_optimizer, training_args
    except ImportError as exc:
        raise RuntimeError(f"cannot import transformers' Trainer internals ({exc})") from exc
    names = getattr(training_args, "OptimizerNames", None)
    handlers = getattr(trainer_optimizer, "_OPTIMIZER_HANDLERS", None)
    if not (isinstance(names, type) and issubclass(names, enum.Enum)) or not isinstance(
        handlers, dict
    ):
        raise RuntimeError(
            "this transformers version has no training_args.OptimizerNames enum and "
            "trainer_optimizer._OPTIMIZER_HANDLERS dict, which hf_fp8 extends to register "
            f"optim='adamw_fp8_coat'; {_PUBLIC_ROUTE}"
        )
    for value, (member_name, expand) in TRAINER_OPTIMIZERS.items():
        try:
            member = _add_enum_member(names, member_name, value)
            ok = names(value) is member and member in list(names)
        except Exception as exc:
            raise RuntimeError(
                f"could not add {value!r} to transformers' OptimizerNames ({exc!r}); "
                f"{_PUBLIC_ROUTE}"
            ) from exc
        if not ok:
            raise RuntimeError(
                f"transformers' OptimizerNames did not accept {value!r}; {_PUBLIC_ROUTE}"
            )
        handlers[member] = functools.partial(_handler, expand)
