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
"""

from __future__ import annotations

import fnmatch
import glob
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def save_pretrained(
    original: Callable, model: nn.Module, save_directory: str | os.PathLike, *args, **kwargs
):
    """``save_pretrained`` of a marked hf_fp8 model: its quantization metadata first made to
    match its layers (``hf_fp8.quantizer.state``: a model whose FP8 layers were all merged
    saves as a plain high-precision checkpoint), then written into a temporary folder and
    renamed into place with its model card, so an interrupted save over an existing
    checkpoint leaves the old one loadable (``hf_fp8.serialization.atomic.atomic_folder``: a
    folder swap, or file-by-file renames inside a folder that cannot be swapped — a mount
    point, the current directory, another user's folder, a read-only parent). Of the files
    already there, only the stale ones of the weight set this save wrote are removed
    (:func:`stale_weights`: its variant's old shards and index, as transformers does); ``.bin``
    files, other variants and, after an adapter-only save, the base weights stay.

    A README.md already in ``save_directory`` that hf_fp8 must not read (a symlink, not a
    regular file, oversized) raises ``UnsafePathError`` before anything is written.

    Saves that push (transformers uploads from the folder itself), that pass options
    positionally or that run on a non-main process go straight to transformers, with the card
    written after.
    """
    if _STATE in model.__dict__:
        from hf_fp8.quantizer.state import sync_quantization_state

        sync_quantization_state(model)  # e.g. after merge_and_unload: save what the model is
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
