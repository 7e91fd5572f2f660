"""Put a model back as it was when peft's ``inject_adapter`` fails part-way.

What peft changes while it injects an adapter lives in the modules' attributes: children
replaced by adapter layers or wrappers (``_modules``), parameters re-registered
(``_parameters``), ``requires_grad`` flags, per-adapter dicts of existing adapter layers (``r``,
``scaling``, ``lora_A`` ...), training flags, hooks, ``config`` (layer replication) and the
adapter's own peft config (peft converts a MoE model's ``LoraConfig`` in place). A
:class:`ModelSnapshot` records all of that, one level deep (no tensor is copied), and
:meth:`ModelSnapshot.restore` writes it back: same module objects in the same places, same
attributes, same flags. Tensor values are recorded only where peft is about to write them: an
init or variant that rewrites the base weight of its target (PiSSA, OLoRA, CorDA, LoftQ,
LoRA-GA, KaSA: :func:`rewrites_base`) on a high-precision target (on an FP8 one hf_fp8 refuses
it first). The ``peft_lora`` patch calls :meth:`ModelSnapshot.keep_values` with each target just
before peft builds its layer there, so targets that exist only after ``layer_replication`` (whose
layers share the weights of the layers they copy) are covered too. The copies are kept on the
CPU until the injection ends.
"""

from __future__ import annotations

from typing import Any

import torch
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


def rewrites_base(config: Any) -> bool:
    """Whether peft writes into the base weight of each target while it injects ``config``:
    ``init_lora_weights`` PiSSA (``pissa_niter_*``), CorDA, OLoRA, LoftQ, LoRA-GA, or the KaSA
    variant (peft 0.21.2: ``LoraLayer.update_layer`` and ``KasaLinearVariant.init``)."""
    from hf_fp8.lora import REWRITING_INITS

    init = getattr(config, "init_lora_weights", None)
    if isinstance(init, str) and init.lower().startswith(REWRITING_INITS):
        return True
    return bool(getattr(config, "kasa_config", None))


def _base_modules(target: nn.Module) -> list[nn.Module]:
    """``target`` and the modules it wraps (peft's ``base_layer`` chain)."""
    found = [target]
    while isinstance(getattr(found[-1], "base_layer", None), nn.Module):
        found.append(found[-1].base_layer)
    return found


class ModelSnapshot:
    """The module tree, attributes and ``requires_grad`` flags of ``modules`` (each root with
    every submodule), of the first root's ``config`` and of each object in ``extra`` (the peft
    config), to put back with :meth:`restore`; plus the values :meth:`keep_values` records."""

    def __init__(self, *roots: nn.Module, extra: tuple[Any, ...] = ()) -> None:
        seen: dict[int, nn.Module] = {}
        for root in roots:
            for module in root.modules():
                seen.setdefault(id(module), module)
        self._modules = [(m, _save(m)) for m in seen.values()]
        params = {id(p): p for m in seen.values() for p in m._parameters.values() if p is not None}
        self._grads = [(p, p.requires_grad) for p in params.values()]
        config = getattr(roots[0], "config", None) if roots else None
        self._config = (config, _save(config)) if hasattr(config, "__dict__") else None
        self._extra = [(obj, _save(obj)) for obj in extra if hasattr(obj, "__dict__")]
        self._values: dict[int, tuple[nn.Parameter, torch.Tensor, torch.device]] = {}

    def keep_values(self, target: nn.Module) -> None:
        """Copy (to the CPU) the values of the parameters of ``target`` and of the layers it
        wraps, each once, before peft writes into them; :meth:`restore` copies them back."""
        for module in _base_modules(target):
            for param in module._parameters.values():
                if param is None or id(param) in self._values or param.is_meta:
                    continue
                with torch.no_grad():
                    saved = param.detach().to("cpu", copy=True)
                self._values[id(param)] = (param, saved, param.device)

    @property
    def kept_bytes(self) -> int:
        """Bytes held by the copies :meth:`keep_values` made."""
        return sum(t.numel() * t.element_size() for _, t, _ in self._values.values())

    def restore(self) -> None:
        """Write everything recorded back (same objects, same attributes, same flags, the kept
        values bit for bit, in place where peft left the tensor's storage the same shape)."""
        for module, saved in self._modules:
            _restore(module, saved)
        for param, requires_grad in self._grads:
            if param.requires_grad != requires_grad:
                param.requires_grad_(requires_grad)
        if self._config is not None:
            _restore(*self._config)
        for obj, saved in self._extra:
            _restore(obj, saved)
        with torch.no_grad():
            for param, saved, device in self._values.values():
                data = param.data
                if (data.shape, data.dtype, data.device) == (saved.shape, saved.dtype, device):
                    data.copy_(saved)
                else:  # peft bound a tensor of another dtype, shape or device
                    param.data = saved.to(device)
