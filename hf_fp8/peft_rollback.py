"""Put a model back as it was when peft's ``inject_adapter`` fails part-way.

What peft changes while it injects an adapter lives in the modules' attributes: children
replaced by adapter layers or wrappers (``_modules``), parameters re-registered
(``_parameters``), ``requires_grad`` flags, per-adapter dicts of existing adapter layers (``r``,
``scaling``, ``lora_A`` ...), training flags, hooks, and ``config`` (layer replication). A
:class:`ModelSnapshot` records all of that, one level deep (no tensor is copied), and
:meth:`ModelSnapshot.restore` writes it back: same module objects in the same places, same
attributes, same flags. Tensor values are not recorded: every setup hf_fp8 knows to write into a
base weight (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, KaSA) is refused before peft runs
(``hf_fp8.peft_preflight``). An init or variant only seen writing when it reaches an FP8 target
(``hf_fp8.lora``: none in peft 0.21.2) leaves its write in a high-precision target handled before.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_Saved = dict[str, tuple[Any, Any]]


def _contents(value: Any) -> Any:
    """A shallow copy of a mutable container's items (restored into the same object)."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    if isinstance(value, set):
        return set(value)
    return None


def _save(obj: Any) -> _Saved:
    return {k: (v, _contents(v)) for k, v in vars(obj).items()}


def _restore(obj: Any, saved: _Saved) -> None:
    attrs = vars(obj)
    for key in [k for k in attrs if k not in saved]:
        del attrs[key]
    for key, (value, contents) in saved.items():
        attrs[key] = value
        if contents is None:
            continue
        if isinstance(value, list):
            value[:] = contents
        else:
            value.clear()
            value.update(contents)


class ModelSnapshot:
    """The module tree, attributes and ``requires_grad`` flags of ``modules`` (each root with
    every submodule) and of the first root's ``config``, to put back with :meth:`restore`."""

    def __init__(self, *roots: nn.Module) -> None:
        seen: dict[int, nn.Module] = {}
        for root in roots:
            for module in root.modules():
                seen.setdefault(id(module), module)
        self._modules = [(m, _save(m)) for m in seen.values()]
        params = {id(p): p for m in seen.values() for p in m._parameters.values() if p is not None}
        self._grads = [(p, p.requires_grad) for p in params.values()]
        config = getattr(roots[0], "config", None) if roots else None
        self._config = (config, _save(config)) if hasattr(config, "__dict__") else None

    def restore(self) -> None:
        """Write everything recorded back (same objects, same attributes, same flags)."""
        for module, saved in self._modules:
            _restore(module, saved)
        for param, requires_grad in self._grads:
            if param.requires_grad != requires_grad:
                param.requires_grad_(requires_grad)
        if self._config is not None:
            _restore(*self._config)
