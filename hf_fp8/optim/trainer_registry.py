"""``TrainingArguments(optim="adamw_fp8_coat")`` / ``optim="adamw_fp8"`` for the stock Trainer.

transformers 5.x turns ``optim`` into the enum ``training_args.OptimizerNames`` (in
``TrainingArguments.__post_init__`` and in ``HfArgumentParser``'s ``choices``), then
``Trainer.get_optimizer_cls_and_kwargs`` looks the member up in
``trainer_optimizer._OPTIMIZER_HANDLERS``. A new name therefore needs an enum member and a
handler; ``hf_fp8.patches.trainer_optimizers`` adds both (idempotently) and this module holds
what they point to. These are private internals: if a future transformers changes them, the
patch is off with one warning, and :func:`register_trainer_optimizers` raises a
``RuntimeError``; both point to the public route::

    Trainer(model, args, optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, {"lr": 1e-4, ...}))

``optim_args`` (``"group_size=64,dynamic_range_expansion=False"``) are parsed into
:class:`~hf_fp8.optim.AdamWFp8` keyword arguments (see :data:`OPTIM_ARGS`).
"""

from __future__ import annotations

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


def _parse_rounding(text: str) -> bool | str:
    """``stochastic_rounding``: a boolean, or ``exp_avg_sq`` (the second moment only); any
    case, as the booleans."""
    if text.strip().lower() == "exp_avg_sq":
        return "exp_avg_sq"
    try:
        return _parse_bool(text)
    except ValueError:
        raise ValueError(
            f"expected exp_avg_sq (the second moment only, the default), true (both moments) "
            f"or false (round-to-nearest) (also 1/yes/on, 0/no/off), got {text!r}"
        ) from None


# optim_args keys accepted by the handler and how their strings are converted.
OPTIM_ARGS: dict[str, Callable[[str], Any]] = {
    "group_size": int,
    "fp8_format": str,
    "dynamic_range_expansion": _parse_bool,
    "min_quantize_numel": int,
    "implementation": str,
    "stochastic_rounding": _parse_rounding,
    "sqrt_second_moment": _parse_bool,
    "moment_format": str,
    "seed": int,
}

_PUBLIC_ROUTE = (
    "pass the optimizer explicitly instead: "
    "Trainer(..., optimizer_cls_and_kwargs=(hf_fp8.AdamWFp8, {'lr': ..., "
    "'dynamic_range_expansion': True}))"
)


def parse_optim_args(optim_args: dict[str, str], optim: str = "adamw_fp8") -> dict[str, Any]:
    """Convert Trainer ``optim_args`` strings into ``AdamWFp8`` keyword arguments (``optim``:
    the Trainer name used, for the errors)."""
    kwargs = {}
    for key, text in optim_args.items():
        if key not in OPTIM_ARGS:
            raise ValueError(
                f'unknown optim_args key {key!r} for optim="{optim}"; accepted: '
                f"{sorted(OPTIM_ARGS)}"
            )
        try:
            kwargs[key] = OPTIM_ARGS[key](text)
        except ValueError as exc:
            raise ValueError(f"optim_args {key}={text!r}: {exc}") from None
    return kwargs


def handler(expand: bool, ctx: Any) -> tuple[type, dict[str, Any]]:
    """Trainer handler: ``(AdamWFp8, kwargs)`` from an ``OptimizerContext``."""
    try:
        kwargs = {**ctx.optimizer_kwargs, **ctx.adam_kwargs}
        optim_args = ctx.optim_args
    except AttributeError as exc:
        raise RuntimeError(
            f"transformers' OptimizerContext changed ({exc}); {_PUBLIC_ROUTE}"
        ) from exc
    optim = next(name for name, (_, on) in TRAINER_OPTIMIZERS.items() if on == expand)
    _check_no_duplicate_keys(getattr(getattr(ctx, "args", None), "optim_args", None), optim)
    parsed = parse_optim_args(optim_args or {}, optim)
    _check_format_fits_the_name(expand, parsed)
    kwargs["dynamic_range_expansion"] = expand
    kwargs.update(parsed)
    return AdamWFp8, kwargs


def _check_no_duplicate_keys(raw: Any, optim: str) -> None:
    """transformers turns ``optim_args`` into a dict (``trainer_optimizer._parse_optim_args``:
    spaces removed, split at ``,`` and ``=``), so a key given twice reaches the handler with
    its last value only. Split the raw string the same way and refuse a repeated key."""
    if not isinstance(raw, str):
        return
    seen: dict[str, str] = {}
    for mapping in raw.replace(" ", "").split(","):
        key = mapping.split("=", 1)[0]
        if key in seen:
            raise ValueError(
                f'optim_args of optim="{optim}" set {key!r} more than once ({seen[key]!r} and '
                f"{mapping!r}; transformers would keep only the last): give each key once, "
                f"optim_args={raw!r}"
            )
        seen[key] = mapping


def _check_format_fits_the_name(expand: bool, parsed: dict[str, Any]) -> None:
    """The plain-FP8 name sets ``dynamic_range_expansion=False`` itself: ``moment_format=log``
    cannot run without expansion (``auto`` is fine: it means the fp8 codes then, as in the
    class). Unless the user set ``dynamic_range_expansion`` in ``optim_args`` too, name the
    optim that fits."""
    fmt = parsed.get("moment_format")
    if expand or fmt != "log" or "dynamic_range_expansion" in parsed:
        return
    plain = next(name for name, (_, on) in TRAINER_OPTIMIZERS.items() if not on)
    coat = next(name for name, (_, on) in TRAINER_OPTIMIZERS.items() if on)
    raise ValueError(
        f'optim="{plain}" is plain per-group FP8 (it sets dynamic_range_expansion=False), and '
        f"moment_format={fmt} needs COAT's expansion: use "
        f'optim="{coat}" with optim_args="moment_format={fmt}"'
    )


_handler = handler  # the name older callers used


def register_trainer_optimizers() -> None:
    """Make ``optim="adamw_fp8_coat"`` and ``optim="adamw_fp8"`` known to transformers now.

    Idempotent; ``import hf_fp8`` already does it when the Trainer modules are imported. Raises
    ``RuntimeError`` (naming the public alternative) when transformers' ``OptimizerNames`` /
    ``_OPTIMIZER_HANDLERS`` are missing or behave differently. The patch itself lives in
    ``hf_fp8.patches.trainer_optimizers``.
    """
    from hf_fp8.patches import apply

    apply("trainer_optimizers", strict=True)
