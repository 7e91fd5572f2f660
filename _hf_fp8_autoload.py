"""Run code right after a named module is imported (a post-import hook), and the autoload.

Two users:

* ``hf-fp8-autoload.pth`` (installed into site-packages next to the package) calls
  :func:`install` at interpreter start. That costs this file only: nothing is imported from
  torch, transformers or hf_fp8 then. When ``transformers.quantizers`` is imported later,
  hf_fp8's config and quantizer are registered with it, so an hf_fp8 checkpoint loads correctly
  in a process that never ran ``import hf_fp8``. ``HF_FP8_AUTOLOAD=0`` turns it off.
* ``hf_fp8.patches`` defers every patch of another library to the moment that library is
  imported, through :func:`when_imported`.

A top-level module on purpose: importing anything inside the ``hf_fp8`` package runs
``hf_fp8/__init__.py`` first. Only the standard library is used here.
"""

from __future__ import annotations

import _thread
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing

if TYPE_CHECKING:  # only builtins are imported at start-up (no typing, importlib.abc, threading)
    from collections.abc import Callable
    from importlib.abc import Loader
    from types import ModuleType

# module name -> callbacks run (in order) after the module has executed successfully
_AFTER: dict[str, list[Callable[[ModuleType], None]]] = {}
# module name -> context-manager factories wrapped around the module's execution
_AROUND: dict[str, list[Callable[[], object]]] = {}
# watched modules that were half-way through their own import when the watch was set: their
# callbacks run at the first import (of anything) or check_pending() after they finish
_PENDING: set[str] = set()
_EXECUTED: set[str] = set()  # watched modules whose code has run to the end
# modules whose loader is hooked even before anyone asks for a callback (see watch)
_WATCHED: set[str] = set()
_LOCK = _thread.RLock()


class _HookedLoader:  # an importlib.abc.Loader
    """Delegates to the module's real loader, then runs the callbacks for its name."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):  # get_resource_reader, is_package, get_source ...
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        name = module.__name__
        managers = [factory() for factory in _AROUND.get(name, ())]
        for manager in managers:
            manager.__enter__()
        try:
            self._loader.exec_module(module)
        finally:
            for manager in reversed(managers):
                manager.__exit__(None, None, None)
        _EXECUTED.add(name)  # importlib still flags it as initializing until we return
        _run_callbacks(name, module)


class _PostImportFinder:  # an importlib.abc.MetaPathFinder
    """First on ``sys.meta_path``; answers only for watched names not yet imported."""

    _busy = _thread._local()

    def find_spec(self, fullname, path=None, target=None):
        if _PENDING:
            check_pending()
        if fullname not in _AFTER and fullname not in _AROUND and fullname not in _WATCHED:
            return None
        if getattr(self._busy, fullname.replace(".", "_"), False):
            return None
        setattr(self._busy, fullname.replace(".", "_"), True)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            setattr(self._busy, fullname.replace(".", "_"), False)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader)
        return spec


def _finder() -> _PostImportFinder:
    with _LOCK:
        for finder in sys.meta_path:
            if type(finder).__name__ == "_PostImportFinder" and hasattr(finder, "_busy"):
                return finder
        finder = _PostImportFinder()
        sys.meta_path.insert(0, finder)
        return finder


def _run_callbacks(name: str, module: ModuleType) -> None:
    with _LOCK:
        callbacks = _AFTER.pop(name, [])
    for callback in callbacks:
        try:
            callback(module)
        except Exception as exc:  # a hook must never break the import that triggered it
            import warnings

            warnings.warn(
                f"hf_fp8: a hook run after importing {name} failed: {exc!r}", stacklevel=2
            )


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (at once if it already is).

    Exceptions from ``callback`` become one warning; the import itself always succeeds.
    """
    module = sys.modules.get(name)
    _finder()
    with _LOCK:
        _AFTER.setdefault(name, []).append(callback)
        if module is not None and _initializing(module):
            _PENDING.add(name)  # executing now, not through our loader: see check_pending
            return
    if module is not None:
        _run_callbacks(name, module)


def _initializing(module: ModuleType) -> bool:
    if module.__name__ in _EXECUTED:
        return False
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def importing(name: str) -> bool:
    """True while module ``name`` is half-way through its import (its code still running)."""
    module = sys.modules.get(name)
    return module is not None and _initializing(module)


def check_pending() -> None:
    """Run the callbacks of watched modules that have finished importing since the watch was
    set half-way through their import."""
    ready = []
    with _LOCK:
        for name in list(_PENDING):
            module = sys.modules.get(name)
            if module is None:  # its import failed: a new import goes through our finder
                _PENDING.discard(name)
            elif not _initializing(module):
                _PENDING.discard(name)
                ready.append((name, module))
    for name, module in ready:
        _run_callbacks(name, module)


def watch(name: str) -> None:
    """Hook the loader of ``name`` when it is imported later, with no callback yet: a
    callback added by :func:`when_imported` half-way through its import (hf_fp8 imported by the
    autoload from inside it) then runs as soon as it finishes, not at the next import."""
    if name in sys.modules:
        return
    _finder()
    with _LOCK:
        _WATCHED.add(name)


def around_import(name: str, factory: Callable[[], object]) -> None:
    """Wrap the execution of ``name`` (when it is imported later) in ``factory()``, a context
    manager (e.g. one that mutes a third-party logger). No effect once ``name`` is imported."""
    if name in sys.modules:
        return
    _finder()
    with _LOCK:
        _AROUND.setdefault(name, []).append(factory)


# The modules whose import registers hf_fp8 with transformers (hf_fp8.patches.PATCHES["quantizers"]).
QUANTIZER_TRIGGERS = ("transformers.quantizers", "transformers.modeling_utils")
# Every module a patch of hf_fp8.patches.PATCHES waits for (a test keeps the two equal). The
# autoload imports hf_fp8 from inside transformers' imports, so one of these can be half-way
# through its import when hf_fp8.patches sets its watch: watched from the start, its patch
# runs when it finishes (TrainingArguments(optim="adamw_fp8_coat") right after
# `from transformers import TrainingArguments; import hf_fp8`).
PATCH_TRIGGERS = (
    "accelerate.accelerator",
    "hf_fp8.quantizer.hf_quantizer",
    "peft.tuners.lora.config",
    "transformers.modeling_utils",
    "transformers.quantizers",
    "transformers.trainer_optimizer",
    "transformers.training_args",
)


def _registrar(step: str) -> Callable[[ModuleType], None]:
    def register(module: ModuleType) -> None:
        from hf_fp8.patches import apply

        apply("quantizers", step=step)

    return register


_INSTALLED = False


def install() -> None:
    """What the ``.pth`` file runs at start-up: register hf_fp8's quantizer with transformers
    when transformers imports its quantizer registry. ``HF_FP8_AUTOLOAD=0`` turns it off."""
    global _INSTALLED
    if os.environ.get("HF_FP8_AUTOLOAD", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    for name in PATCH_TRIGGERS:
        watch(name)
    for name in QUANTIZER_TRIGGERS:
        when_imported(name, _registrar(name))
