"""Patch: ``TrainingArguments(optim="adamw_fp8_coat" | "adamw_fp8")`` for the stock Trainer.

transformers 5.x turns ``optim`` into the enum ``training_args.OptimizerNames`` (in
``TrainingArguments.__post_init__`` and in ``HfArgumentParser``'s ``choices``), then
``Trainer.get_optimizer_cls_and_kwargs`` looks the member up in
``trainer_optimizer._OPTIMIZER_HANDLERS``. A new name needs an enum member (added as soon as
``transformers.training_args`` is imported, before any parser reads the choices) and a handler
(added when ``transformers.trainer_optimizer`` is imported). Both are private internals; the
public route is ``Trainer(optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, {...}))``.
"""

from __future__ import annotations

import enum
import functools
import sys
from types import ModuleType

NAMES_MODULE = "transformers.training_args"
HANDLERS_MODULE = "transformers.trainer_optimizer"


def _module(name: str) -> ModuleType:
    module = sys.modules.get(name)
    if module is None:
        import importlib

        module = importlib.import_module(name)
    return module


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


def add_names() -> dict[str, enum.Enum]:
    """Add the optimizer names to ``OptimizerNames``; returns ``{value: member}``."""
    from hf_fp8.optim.trainer_registry import TRAINER_OPTIMIZERS

    names = getattr(_module(NAMES_MODULE), "OptimizerNames", None)
    if not (isinstance(names, type) and issubclass(names, enum.Enum) and issubclass(names, str)):
        raise RuntimeError("transformers.training_args.OptimizerNames is not a str enum any more")
    members = {}
    for value, (member_name, _) in TRAINER_OPTIMIZERS.items():
        member = _add_enum_member(names, member_name, value)
        if names(value) is not member or member not in list(names):
            raise RuntimeError(f"OptimizerNames did not accept {value!r}")
        members[value] = member
    return members


def add_handlers() -> None:
    """Add both names and their handlers to ``trainer_optimizer._OPTIMIZER_HANDLERS``."""
    from hf_fp8.optim.trainer_registry import TRAINER_OPTIMIZERS, handler

    members = add_names()
    handlers = getattr(_module(HANDLERS_MODULE), "_OPTIMIZER_HANDLERS", None)
    if not isinstance(handlers, dict):
        raise RuntimeError(
            "transformers.trainer_optimizer._OPTIMIZER_HANDLERS is not a dict any more"
        )
    for value, (_, expand) in TRAINER_OPTIMIZERS.items():
        handlers[members[value]] = functools.partial(handler, expand)


def applied() -> bool:
    """True when both names have a handler in ``_OPTIMIZER_HANDLERS``."""
    handlers = getattr(sys.modules.get(HANDLERS_MODULE), "_OPTIMIZER_HANDLERS", None)
    if not isinstance(handlers, dict):
        return False
    values = {getattr(key, "value", key) for key in handlers}
    return {"adamw_fp8_coat", "adamw_fp8"} <= values


def apply() -> None:
    """Both steps now (imports the Trainer's optimizer module)."""
    add_handlers()


TRIGGERS = {NAMES_MODULE: add_names, HANDLERS_MODULE: add_handlers}
