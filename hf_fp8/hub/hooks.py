"""Model cards on ``save_pretrained`` and ``push_to_hub`` of models loaded through hf_fp8.

After an hf_fp8 load, :func:`attach_card_hooks` marks the model (state in its
``__dict__``, so copies keep it) and makes sure the ``model_card`` patch
(``hf_fp8.patches.model_card``) wraps two ``PreTrainedModel`` methods, which call
:func:`save_pretrained` and :func:`before_upload` here for marked models only:
``save_pretrained`` writes the checkpoint atomically with ``README.md`` next to the weights,
and before ``push_to_hub`` uploads, the placeholder card transformers wrote is replaced with
hf_fp8's. A card problem never fails a save or a push (one warning), except an existing
README.md hf_fp8 must not read (a symlink out of the folder, a FIFO, a folder, an oversized
file: ``hf_fp8.hub.card_file``), which fails them with ``UnsafePathError`` before anything is
written or uploaded; at load it is ignored with a warning. Figures recorded for a card hold
for the compute dtype they were measured in only (``card_info.recorded_fidelity``). Nothing
here touches the network.

``save_pretrained(state_dict=...)`` (``Trainer._save``, FSDP / DeepSpeed gathered saves) saves
the state dict passed, as for a high-precision model: transformers asks the quantizer for the
state dict to write and would write ``model.state_dict()`` instead (R31 F3, the edits lost).
:func:`save_pretrained` checks that state dict first (:func:`check_state_dict`: every FP8
layer's codes with their scales, no fp8 codes without a scale), refusing an inconsistent one
before anything is written, and hands it to ``Fp8HfQuantizer.get_state_dict_and_metadata``
(``hf_fp8.quantizer.hf_quantizer.SAVING``) with the input-scale record of what it holds
(:func:`state_dict_record`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import inspect
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_fp8.config import Fp8Config
from hf_fp8.hub.card import read_card_info, same_compute_dtype, write_model_card
from hf_fp8.hub.card_file import read_card
from hf_fp8.hub.card_info import (
    FIDELITY_DTYPE,
    compute_dtype_name,
    hub_model_id,
    info_from_model,
)
from hf_fp8.modules import Fp8Experts, Fp8Linear
from hf_fp8.modules.fp8_linear import input_scale_above_bound
from hf_fp8.numerics import fp8_dtype, is_fp8
from hf_fp8.numerics.checks import input_scale_problem
from hf_fp8.utils.folders import UnsafePathError

_STATE = "_hf_fp8_card"


def _is_fp8(model: nn.Module) -> bool:
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    return isinstance(qc, Fp8Config) and any(
        isinstance(m, (Fp8Linear, Fp8Experts)) for m in model.modules()
    )


def _local_name(path: str | os.PathLike) -> str:
    """A folder's own name: cards never carry the local directory layout."""
    return Path(path).name or str(path)


def _previous_card(name_or_path: str) -> str | None:
    """README.md of the folder or cached repo a model was loaded from (never downloads). One
    that hf_fp8 must not read (a symlink out of the folder, not a regular file, oversized:
    ``hf_fp8.hub.card_file``) is ignored with a warning: it never fails the load."""
    if not name_or_path:
        return None
    folder = Path(name_or_path)
    if not folder.is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name_or_path, "README.md")
        except Exception:  # not a repo id
            return None
        if not isinstance(cached, str):
            return None
        folder = Path(cached).parent  # the snapshot: its README.md links into blobs/
    try:
        return read_card(folder)
    except UnsafePathError as exc:
        warnings.warn(
            f"hf_fp8: the model card of {name_or_path} is not read ({exc}); the card of a "
            "save of this model names no base model or figures from it",
            UserWarning,
            stacklevel=2,
        )
        return None


def set_card_info(
    model: nn.Module, *, base_model: str | None = None, fidelity: dict[str, Any] | None = None
) -> None:
    """Record facts for the model card: the base model (a Hub id) and fidelity figures the
    user measured (e.g. ``{"mean cosine vs fp32": 0.9987}``)."""
    state = model.__dict__.setdefault(_STATE, {})
    if base_model is not None:
        state["base_model"] = str(base_model)
    if fidelity is not None:
        state["fidelity"] = {str(k): v for k, v in fidelity.items()}
        state[FIDELITY_DTYPE] = compute_dtype_name(model)  # they hold for this dtype only


def weight_files(variant: str | None = None) -> tuple[str, ...]:
    """``atomic_folder`` drop patterns of the weight set one ``save_pretrained`` writes
    (transformers 5 writes safetensors only): ``model{.variant}.safetensors``, its index
    ``model.safetensors.index{.variant}.json`` and its shards
    ``model{.variant}-NNNNN-of-NNNNN.safetensors`` (transformers' ``_add_variant`` names).
    ``.bin`` files, other variants and everything else in the folder are never among them."""
    v = f".{glob.escape(variant)}" if variant else ""
    digits = "[0-9]" * 5
    return (
        f"model{v}.safetensors",
        f"model.safetensors.index{v}.json",
        f"model{v}-{digits}-of-{digits}.safetensors",
    )


# The main (no variant) weight set: an older one in the folder is replaced, not kept.
WEIGHT_FILES = weight_files()


def stale_weights(variant: str | None = None) -> Callable[[Path], tuple[str, ...]]:
    """``drop`` for ``atomic_folder``: called on the temporary folder once the save ran, it
    names the files of the weight set written (:func:`weight_files`) when the save wrote
    that set, and nothing when it did not (an adapter-only save of a model with a PEFT
    adapter attached writes ``adapter_model.safetensors`` only: the base weights stay)."""
    names = weight_files(variant)

    def drop(tmp: Path) -> tuple[str, ...]:
        written = os.listdir(tmp)
        wrote = any(fnmatch.fnmatchcase(f, pattern) for f in written for pattern in names)
        return names if wrote else ()

    return drop


def _marked(model: nn.Module) -> bool:
    return _STATE in model.__dict__ and _is_fp8(model)


def _write_card(model: nn.Module, folder: Path, existing: str | None, **render_kwargs) -> None:
    """Write the card into ``folder``; a card problem warns and never fails the save."""
    try:
        write_model_card(folder, info_from_model(model), existing=existing, **render_kwargs)
    except Exception as exc:
        warnings.warn(
            f"hf_fp8: the model card was not written ({type(exc).__name__}: {exc}); the "
            f"checkpoint in {folder} is complete. Write it later with "
            "hf_fp8.hub.write_model_card(folder, hf_fp8.hub.info_from_model(model))",
            stacklevel=3,
        )


class StateDictError(ValueError):
    """``save_pretrained(state_dict=...)`` of an hf_fp8 model got a state dict that would not
    reload: an FP8 layer's codes without their scales, fp8 codes where the model has no FP8
    layer, high-precision values in place of fp8 codes."""


_STATE_DICT_FIX = (
    "Pass the model's full state dict with your edits (model.state_dict(), each FP8 layer's "
    "fp8 codes with their weight_scale, as hf_fp8 saves them); to save edited high-precision "
    "weights, dequantize first (model.dequantize(), then save_pretrained) or quantize them "
    "again (hf_fp8.quantize_model on the high-precision model)"
)


def _fp8_tensor_names(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, str, str]]:
    """``(module name, module, codes, weight scale, input scale)`` tensor names of every FP8
    layer (an ``Fp8Experts`` once per projection), as ``model.state_dict()`` names them."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, Fp8Linear):
            yield (
                name,
                module,
                f"{prefix}weight",
                f"{prefix}weight_scale",
                f"{prefix}input_scale",
            )
        elif isinstance(module, Fp8Experts):
            for proj in module.layout.projections:
                yield (
                    name,
                    module,
                    f"{prefix}{proj}",
                    f"{prefix}{proj}_weight_scale",
                    f"{prefix}{proj}_input_scale",
                )


def _refuse(key: str, problem: str) -> StateDictError:
    return StateDictError(
        f"hf_fp8: save_pretrained(state_dict=...): {key} {problem}; the checkpoint would not "
        f"reload, so nothing was written. {_STATE_DICT_FIX}"
    )


def _values(t: Any) -> torch.Tensor | None:
    """``t``'s values as a plain tensor to check, or None where they cannot be read here (meta,
    a DTensor shard, a fake tensor, a wrapper subclass without data). Other tensor subclasses
    are read through ``as_subclass(torch.Tensor)`` (R36: a subclass skipped the checks and a
    NaN or negative scale was written)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    if type(t) in (torch.Tensor, nn.Parameter):
        return t
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor | FakeTensor):
        return None
    try:
        plain = t.as_subclass(torch.Tensor)
        plain.reshape(-1)[:1].tolist()  # has readable data
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return plain


def _check_like(key: str, value: Any, reference: torch.Tensor, what: str) -> None:
    """``value`` (the state dict's ``key``) has ``reference``'s dtype and shape."""
    if not isinstance(value, torch.Tensor):
        raise _refuse(key, f"is a {type(value).__name__}, not a tensor")
    if value.dtype != reference.dtype:
        raise _refuse(
            key,
            f"is {str(value.dtype).removeprefix('torch.')} where the model's {what} is "
            f"{str(reference.dtype).removeprefix('torch.')}",
        )
    if tuple(value.shape) != tuple(reference.shape):
        raise _refuse(
            key, f"has shape {tuple(value.shape)}, the model's {what} {tuple(reference.shape)}"
        )


def _check_scale_values(key: str, value: torch.Tensor) -> None:
    plain = _values(value)
    if plain is not None and plain.numel() and not bool(((plain > 0) & plain.isfinite()).all()):
        raise _refuse(key, "holds a scale that is not a finite positive number")


def _check_input_scale(key: str, value: Any, module: nn.Module) -> None:
    """``value``, the state dict's input scale ``key`` of the FP8 layer ``module``, is what the
    reload accepts: float32 of the shape the layer stores (``[1]`` for an ``Fp8Linear``, one
    per expert ``[E]`` for an ``Fp8Experts``; the layer's own tensor's where it has one), checked
    before its values (an fp8 or complex tensor has no ``>``), then finite, > 0 and within the
    bounds of the layer's format, as ``check_scale_tensor`` checks it at reload (R32 F2/F3:
    ``[3]`` or fp16 was written and did not reload, fp8 failed in torch)."""
    if isinstance(module, Fp8Experts):
        proj = key.rpartition(".")[2].removesuffix("_input_scale")
        current, shape = getattr(module, f"{proj}_input_scale"), (module.num_experts,)
    else:
        current, shape = module.input_scale, (1,)
    if isinstance(current, torch.Tensor):
        shape = tuple(current.shape)
    if not isinstance(value, torch.Tensor):
        raise _refuse(key, f"is a {type(value).__name__}, not a tensor")
    if value.dtype != torch.float32 or tuple(value.shape) != shape:
        raise _refuse(
            key,
            f"is {str(value.dtype).removeprefix('torch.')} of shape {tuple(value.shape)} where "
            f"the layer stores its input scale as float32 of shape {shape}",
        )
    plain = _values(value)
    if plain is None:
        return
    fp8 = fp8_dtype(module.fp8_format)
    problem = input_scale_problem("its value", plain, fp8) or input_scale_above_bound(
        "its value", plain, fp8, module.compute_dtype
    )
    if problem:
        raise _refuse(key, f"is an input scale the reload refuses ({problem})")


def _prefixed_hint(state_dict: Mapping[str, Any], key: str) -> str:
    """A hint when ``state_dict`` holds ``key`` under a wrapper's prefix (torch.compile's
    ``_orig_mod.``, DDP's ``module.``): a state dict taken from the wrapper, not the model."""
    found = next((k for k in state_dict if k.endswith(f".{key}")), None)
    if found is None:
        return ""
    return (
        f"; the state dict has {found}: names with a wrapper's prefix (torch.compile's "
        "_orig_mod., DistributedDataParallel's module.), which would not reload either. Pass "
        "the state dict of the unwrapped model"
    )


def check_state_dict(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Refuse (``StateDictError``, naming the key and the fix) a state dict passed to
    ``save_pretrained`` of the hf_fp8 ``model`` that would not reload: an FP8 layer of the
    model without its fp8 codes, weight scale or bias in it, any of them with another dtype or
    shape than the layer's (high-precision values where the layer stores fp8 codes), a scale
    that is not finite and positive, an input scale that is not float32 of the layer's shape
    or not within the bounds the reload accepts, or fp8 codes under a name that is no FP8
    layer's (codes without their scale). Other entries (norms, embeddings, high-precision layers) are not
    checked, as for a high-precision model."""
    codes: set[str] = set()
    for layer, module, key, scale_key, input_key in _fp8_tensor_names(model):
        codes.add(key)
        if isinstance(module, Fp8Experts):
            proj = key.rpartition(".")[2]
            tensors = {
                key: (getattr(module, proj), "fp8 codes"),
                scale_key: (getattr(module, f"{proj}_weight_scale"), "weight scale"),
            }
            bias = getattr(module, f"{proj}_bias", None)
            bias_key = f"{key}_bias"
        else:
            tensors = {
                key: (module.weight, "fp8 codes"),
                scale_key: (module.weight_scale, "weight scale"),
            }
            bias = module.bias
            bias_key = key.removesuffix("weight") + "bias"
        if isinstance(bias, torch.Tensor):
            tensors[bias_key] = (bias, "bias")
        for k, (reference, what) in tensors.items():
            if k not in state_dict:
                raise _refuse(
                    k,
                    f"is missing: the FP8 layer {layer or 'model'} needs its {what} "
                    f"({', '.join(tensors)}){_prefixed_hint(state_dict, k)}",
                )
            _check_like(k, state_dict[k], reference, what)
        _check_scale_values(scale_key, state_dict[scale_key])
        if input_key in state_dict:
            _check_input_scale(input_key, state_dict[input_key], module)
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and is_fp8(value.dtype) and key not in codes:
            raise _refuse(
                key,
                f"holds fp8 codes ({str(value.dtype).removeprefix('torch.')}) but is no FP8 "
                "layer's weight in the model: saved without a scale, it would reload as "
                "plain numbers",
            )


def state_dict_record(
    model: nn.Module, state_dict: Mapping[str, Any], metadata: dict[str, str]
) -> dict[str, str]:
    """``metadata`` (the model's, ``input_scales_metadata``) with its input-scale record made
    that of ``state_dict``: the static input scales it holds. A state dict that lacks some of
    the model's scales is saved as it is, and reloads as saved (the layers without a stored
    scale take the config's fallback ``activation_scale`` or ask for calibration, as after a
    save with those scales unset), with one warning naming them."""
    from hf_fp8.quantizer.input_scales import RECORD_KEY, model_input_scales

    if RECORD_KEY not in metadata:
        return metadata
    static = []
    for _, module, _, _, input_key in _fp8_tensor_names(model):
        if isinstance(module, Fp8Linear):
            if module.activation_scheme == "static":
                static.append(input_key)
        elif module.recipe.is_static:
            static.append(input_key)
    held = sorted(k for k in static if k in state_dict)
    dropped = sorted(set(model_input_scales(model)) - set(held))
    if dropped:
        shown = ", ".join(dropped[:5]) + (" …" if len(dropped) > 5 else "")
        warnings.warn(
            f"hf_fp8: the state dict passed to save_pretrained lacks {len(dropped)} input "
            f"scale(s) the model has ({shown}); the checkpoint is saved without them and "
            "records so: these layers reload with the config's fallback activation_scale, or "
            "ask for calibration. Pass model.state_dict() to keep them",
            UserWarning,
            stacklevel=6,  # the caller of save_pretrained
        )
    return {**metadata, RECORD_KEY: json.dumps(held)}


def _save_arguments(
    original: Callable, model: nn.Module, save_directory: Any, args: tuple, kwargs: dict
) -> tuple[Any, bool]:
    """The ``state_dict`` and ``is_main_process`` this ``save_pretrained`` call passes
    (keyword or positional)."""
    try:
        bound = inspect.signature(original).bind(model, save_directory, *args, **kwargs)
    except (TypeError, ValueError):  # transformers raises its own error for the call
        return kwargs.get("state_dict"), bool(kwargs.get("is_main_process", True))
    return bound.arguments.get("state_dict"), bool(bound.arguments.get("is_main_process", True))


@contextlib.contextmanager
def _handing_state_dict(
    original: Callable, model: nn.Module, save_directory: Any, args: tuple, kwargs: dict
) -> Iterator[None]:
    """For the length of the save: the state dict passed, checked, handed to hf_fp8's
    quantizer with the input-scale record of what it holds (``SAVING``); a save without one
    (or of another kind of model) hands none, also when it runs inside a save that passed one
    (R32 S1: a save of the same model started from within it got the outer state dict)."""
    from hf_fp8.quantizer import hf_quantizer

    state_dict, main = _save_arguments(original, model, save_directory, args, kwargs)
    handed = None
    if state_dict is not None and isinstance(
        getattr(model, "hf_quantizer", None), hf_quantizer.Fp8HfQuantizer
    ):
        from hf_fp8.quantizer.input_scales import input_scales_metadata

        metadata = input_scales_metadata(model)
        # an adapter save (peft config loaded) writes adapter weights only; another process
        # than the main one writes nothing
        if main and not getattr(model, "_hf_peft_config_loaded", False):
            check_state_dict(model, state_dict)
            metadata = state_dict_record(model, state_dict, metadata)
        handed = (model, state_dict, metadata)
    saving = getattr(hf_quantizer, "SAVING", None)  # hf26-save-state-dict.diff
    if saving is None:
        yield
        return
    token = saving.set(handed)
    try:
        yield
    finally:
        saving.reset(token)


def save_pretrained(
    original: Callable, model: nn.Module, save_directory: str | os.PathLike, *args, **kwargs
):
    """``save_pretrained`` of a model loaded or quantized by hf_fp8: a ``state_dict=`` passed
    is what is saved (:func:`check_state_dict`, then handed to the quantizer); the rest is
    :func:`_save_marked`."""
    if _STATE in model.__dict__:
        from hf_fp8.quantizer.state import sync_quantization_state

        sync_quantization_state(model)  # e.g. after merge_and_unload: save what the model is
    with _handing_state_dict(original, model, save_directory, args, kwargs):
        return _save_marked(original, model, save_directory, *args, **kwargs)


def _save_marked(
    original: Callable, model: nn.Module, save_directory: str | os.PathLike, *args, **kwargs
):
    """``save_pretrained`` of a marked hf_fp8 model, its quantization metadata made to match its
    layers first (:func:`save_pretrained`, ``hf_fp8.quantizer.state``: a model whose FP8 layers
    were all merged saves as a plain high-precision checkpoint): written into a temporary folder
    and renamed into place with its model card, so an interrupted save over an existing
    checkpoint leaves the old one loadable (``hf_fp8.serialization.atomic.atomic_folder``: a
    folder swap, or file-by-file renames inside a folder that cannot be swapped — a mount point,
    the current directory, another user's folder, a read-only parent). Of the files already
    there, only the stale ones of the weight set this save wrote are removed
    (:func:`stale_weights`: its variant's old shards and index, as transformers does); ``.bin``
    files, other variants and, after an adapter-only save, the base weights stay.

    A README.md already in ``save_directory`` that hf_fp8 must not read (a symlink, not a
    regular file, oversized) raises ``UnsafePathError`` before anything is written.

    Saves that push (transformers uploads from the folder itself), that pass options
    positionally or that run on a non-main process go straight to transformers, with the card
    written after.
    """
    if not _marked(model):
        return original(model, save_directory, *args, **kwargs)
    dest = Path(save_directory)
    direct = (
        args
        or kwargs.get("push_to_hub")
        or not kwargs.get("is_main_process", True)
        or (dest.exists() and not dest.is_dir())
    )
    # never followed nor copied: a linked / special / oversized README.md fails the save
    # before anything is written (hf_fp8.hub.card_file)
    existing = read_card(dest) if dest.is_dir() else None
    if direct:
        result = original(model, save_directory, *args, **kwargs)
        if not kwargs.get("push_to_hub") and kwargs.get("is_main_process", True) and dest.is_dir():
            _write_card(model, dest, existing, model_id=_local_name(dest))
        return result
    from hf_fp8.serialization.atomic import atomic_folder

    with atomic_folder(dest, drop=stale_weights(kwargs.get("variant"))) as tmp:
        result = original(model, tmp, **kwargs)
        _write_card(model, tmp, existing, model_id=_local_name(dest))
    return result


def before_upload(model: nn.Module, working_dir: str | os.PathLike, repo_id: str) -> None:
    """Before transformers uploads ``working_dir`` (``push_to_hub``): replace the placeholder
    card it wrote with hf_fp8's. Never fails the push, except for a README.md hf_fp8 must not
    read (a symlink out of the folder, not a regular file: ``UnsafePathError``), which the
    upload would otherwise follow."""
    if _marked(model):
        existing = read_card(working_dir)
        try:
            info = info_from_model(model, repo_id=repo_id)
            write_model_card(working_dir, info, existing=existing)
        except Exception as exc:
            warnings.warn(
                f"hf_fp8: the model card was not written ({type(exc).__name__}: {exc}); "
                "the push goes on with transformers' card",
                stacklevel=3,
            )


def attach_card_hooks(model: nn.Module, hf_quantizer: Any = None) -> None:
    """Make ``model``'s saves and pushes carry hf_fp8's model card (idempotent). The base
    model is the checkpoint quantized on the fly, or what the card of a reloaded FP8
    checkpoint names."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    from hf_fp8.patches import apply

    apply("model_card")
    state = model.__dict__.setdefault(_STATE, {})
    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    if hf_quantizer is not None and getattr(hf_quantizer, "pre_quantized", False):
        previous = read_card_info(_previous_card(name) or "")
        if previous is not None:
            state.setdefault("base_model", previous.base_model)
            # figures measured in another compute dtype (or an unknown one) do not hold
            if "fidelity" not in state and same_compute_dtype(
                previous.compute_dtype, compute_dtype_name(model)
            ):
                state["fidelity"] = previous.fidelity
                state[FIDELITY_DTYPE] = previous.compute_dtype
    elif name:
        state.setdefault("base_model", hub_model_id(name) or _local_name(name))
