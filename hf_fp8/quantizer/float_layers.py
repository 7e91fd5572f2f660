"""On-the-fly loads (a high-precision checkpoint + ``Fp8Config``): what the checkpoint holds.

The float model transformers would load initialises a layer the checkpoint does not store as
the model has it: one it lacks (a masked-LM BERT loaded as ``AutoModel``: the pooler; a
decoder given cross-attention; a config with more layers than stored) or, under
``ignore_mismatched_sizes=True``, one stored with another shape. As an ``Fp8Linear`` such a
layer would have no weight to quantize, so it stays a plain layer while loading (transformers
initialises it, or reports the size mismatch, exactly as for the float model, with the same
random numbers) and is quantized right after loading (R39 F1, F4): the model is the float
model loaded the same way, then quantized.

The tensor names and shapes come from the headers of the checkpoint's ``.safetensors`` files
(no tensor data is read): they also say whether the checkpoint stores FP8 scales, which an
on-the-fly load refuses (it is FP8 already).
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Sequence

from safetensors import SafetensorError, safe_open
from torch import nn

from hf_fp8.modules import convertible_modules
from hf_fp8.modules.replace import _build_linears
from hf_fp8.quantizer.new_layers import loaded_name_map
from hf_fp8.utils.safetensors_header import _header_fits


def stored_shapes(files: Sequence[str]) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` of the checkpoint ``files`` (their ``.safetensors``
    headers); ``None`` when there are none or one is not a readable safetensors file."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if not str(file).endswith(".safetensors"):
            return None
        try:
            if not _header_fits(file):
                return None
            handle = safe_open(os.fspath(file), "pt")
        except (OSError, SafetensorError, ValueError, struct.error):
            return None
        with handle as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})  # noqa: SIM118
    return shapes if files else None


def loaded_shapes(
    model: nn.Module,
    shapes: dict[str, tuple[int, ...]] | None,
    key_mapping: dict[str, str] | None = None,
) -> dict | None:
    """``shapes`` under the names the loader gives the tensors in ``model`` (``key_mapping``:
    the one passed to ``from_pretrained``; ``None`` for a tensor a converter makes: its shape
    is known after loading only; a tensor a converter splits is under each of its names)."""
    if shapes is None:
        return None
    names = loaded_name_map(model, shapes, key_mapping)
    if names is None:
        return None
    out: dict[str, tuple[int, ...] | None] = {}
    for key, shape in shapes.items():
        renamed, converted, more = names[key]
        # a tensor a WeightConverter merges or splits has another shape on disk: None (unknown)
        for name in (renamed, *more):
            out[name] = None if converted else shape
    return out


def layers_to_initialise(
    model: nn.Module, stored: dict[str, tuple[int, ...]] | None, skip: Sequence[str]
) -> list[str]:
    """The layers to convert (``skip`` aside) whose ``weight`` or ``bias`` the checkpoint
    (``stored``: loaded name -> shape) does not store with the module's shape, under any of
    the layer's names (a layer shared by two parents). ``[]`` when ``stored`` is ``None``, or
    when it stores no weight of any of them (renamed in a way not followed here: the
    quantize op and the checks after loading decide, as before)."""
    if stored is None:
        return []
    groups: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module, _ in convertible_modules(model, skip=skip):
        groups.setdefault(id(module), []).append((name, module))
    if not any(f"{n}.weight" in stored for group in groups.values() for n, _ in group):
        return []
    found: list[str] = []
    for group in groups.values():
        module = group[0][1]
        tensors = {"weight": tuple(module.weight.shape)}
        if module.bias is not None:
            tensors["bias"] = tuple(module.bias.shape)

        def as_model(name: str, tensors: dict = tensors) -> bool:
            return all(
                f"{name}.{t}" in stored and stored[f"{name}.{t}"] in (None, shape)
                for t, shape in tensors.items()
            )

        if not any(as_model(name) for name, _ in group):
            found += [name for name, _ in group]
    return found


def quantize_initialised(model: nn.Module, names: Sequence[str], config) -> list[str]:
    """Quantize the layers ``names`` (kept high precision while loading, then initialised by
    transformers) with ``config``, as ``hf_fp8.quantize_model`` does; return those left in
    high precision: a layer accelerate dispatched (its hooks would not move to a new module)
    or left on the meta device, with a warning naming them."""
    wanted = set(names)
    targets, kept = [], []
    for name, module, parent in convertible_modules(model):
        if name not in wanted:
            continue
        if hasattr(module, "_hf_hook") or module.weight.is_meta:
            kept.append(name)
            continue
        targets.append((name, module, parent))
    for parent, attr, new in _build_linears(config, targets):
        for p in new.parameters(recurse=False):
            p._is_hf_initialized = True  # loaded, not to be initialised again
        setattr(parent, attr, new)
    if kept:
        shown = ", ".join(kept[:3]) + (" …" if len(kept) > 3 else "")
        warnings.warn(
            f"hf_fp8: {len(kept)} layer(s) the checkpoint does not store as the model has "
            f"them ({shown}) were initialised by transformers and are kept in high precision: "
            "accelerate placed them with hooks (device_map). To quantize them, load without "
            "that device_map, or call hf_fp8.quantize_model on the loaded model",
            UserWarning,
            stacklevel=3,
        )
    return kept


def stored_fp8_scales(model: nn.Module, stored: dict | None, is_scale) -> list[str]:
    """The checkpoint tensors (loaded names of ``stored``) that are FP8 scales of the
    model's FP8 layers (``is_scale(module, tensor_name)``): the checkpoint is FP8 already."""
    if stored is None:
        return []
    found = []
    for key in stored:
        module_name, _, tensor = key.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue
        if is_scale(module, tensor):
            found.append(key)
    return sorted(found)
