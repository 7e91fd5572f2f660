"""Inductor-compiled helpers for the emulated FP8 kernels, with an eager fallback.

Eager fp8 → bf16 casts are scalar on many CPUs (~3.5 ns/element); inductor emits one
vectorized pass per helper. Each static configuration (dtypes, granularities) gets its own
copy of the function's code object, hence its own dynamo cache: dynamo caches per code
object and falls back to eager after ``recompile_limit`` (8) variants, which one process
running several recipes would otherwise reach without a word.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

_FAILED: set[Hashable] = set()
_SEEN: set[Hashable] = set()
_SEEN_SLOW: list[float] = []
logger = logging.getLogger("hf_fp8")


def compile_enabled() -> bool:
    """Emulation helpers are compiled with inductor unless ``HF_FP8_COMPILE=0``."""
    return os.environ.get("HF_FP8_COMPILE", "1").lower() not in ("0", "false", "no", "off")


def _clone(fn: Callable, name: str) -> Callable:
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    clone = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone


@functools.cache
def _compiled(fn: Callable, key: Hashable) -> Callable:
    name = f"{fn.__name__}_{len(_compiled_names)}"
    _compiled_names.append(name)
    return torch.compile(_clone(fn, name), dynamic=True)


_compiled_names: list[str] = []


def run(fn: Callable, *args: Any, **static: Hashable) -> Any:
    """``fn(*args, **static)``, compiled by inductor once per value of ``static``.

    ``fn`` must be pure: it may receive contiguous copies of its tensor arguments.

    Runs ``fn`` eagerly when compilation is disabled, when the caller is itself being
    compiled (the user's ``torch.compile`` traces the eager body), for meta tensors, and
    after a compilation failure (with one warning: correct but slower). An error that the
    eager function raises as well is the caller's and propagates.
    """
    # Checked first: under the user's torch.compile the key below would be traced too, and
    # dynamo cannot sort static values that became symbolic (dynamic=True): a graph break.
    if torch.compiler.is_compiling():
        return fn(*args, **static)
    key = (fn, tuple(sorted(static.items())))
    if (
        not compile_enabled()
        or key in _FAILED
        or any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
    ):
        return fn(*args, **static)
    # Pass plain, contiguous, base-less tensors. Dynamo guards on what it is given: a
    # Parameter gets static shapes even with dynamic=True, a view (an input reshaped to 2-D)
    # guards on its base's sizes, a strided input on its strides — each a recompile, and
    # eager after 8 of them. detach() drops both the Parameter type and the base; callers
    # never need autograd here (the FP8 autograd Function runs its forward without grad).
    args = tuple(a.detach().contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    try:
        if key in _SEEN:
            return _compiled(fn, key)(*args, **static)
        start = time.perf_counter()
        out = _compiled(fn, key)(*args, **static)
        _SEEN.add(key)
        seconds = time.perf_counter() - start
        if seconds > 1.0 and not _SEEN_SLOW:  # the slow first call: say so, once
            _SEEN_SLOW.append(seconds)
            logger.warning(
                "hf_fp8: inductor compiled the FP8 emulation (%s) in %.1f s on its first call; "
                "other recipes compile on their first call too, new shapes do not. "
                "HF_FP8_COMPILE=0 skips compiling (slower eager emulation)",
                fn.__name__,
                seconds,
            )
        return out
    except Exception as err:
        # Bad inputs fail eagerly too and raise from here; only a compiler failure
        # (no C++ compiler, an inductor bug) turns compilation off for this configuration.
        result = fn(*args, **static)
        _FAILED.add(key)
        warnings.warn(
            f"hf_fp8: compiling {fn.__name__} failed ({type(err).__name__}: {err}); using the "
            "eager FP8 emulation (slower). Set HF_FP8_COMPILE=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return result
