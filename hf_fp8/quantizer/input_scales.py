"""Static input scales of a pre-quantized load: all stored, or none.

A static checkpoint saved before calibration stores no ``input_scale``: its layers take the
config's ``activation_scale`` (or ask for ``hf_fp8.calibrate``). One saved after calibration
stores them all. A checkpoint with some of them and not the others lost tensors: the missing
layers would quietly run with the config's fallback instead of their calibrated scale
(reviewer R2: calibrated 0.000202 came back 0.05, outputs 1.6 % off), so it is refused.

Which scales are stored is read from the checkpoint's tensor names (its shard headers), not
from where a layer went: a disk-offloaded layer's tensors stay on meta whether or not the file
has them. An offloaded layer reads every tensor from the checkpoint at forward time, so one
with no stored scale cannot take the config's fallback: refused at load, naming the fix
(before: a false "lacks … while it stores …", or ``KeyError`` at forward).

A config that gives scales to some layers only (``activation_scales`` without a fallback
``activation_scale``) saves exactly those: the other layers have none until calibration. Such a
checkpoint is not partial (reviewer R27 F4: it was refused as "lacks 13 … calibrated"): it
loads when the stored scales are exactly the config's ``activation_scales`` — every name
stored is a key, every key is stored, each value equals the key's — and no fallback is set. A
calibrated checkpoint that lost its other scales fails the value test (calibration overwrote
the given values) and is still refused.

Scales set by hand on some layers only (``set_input_scale``, gap 12.3) are not in the config:
``save_pretrained`` records in every shard's safetensors metadata which input scales it saves
(``RECORD_KEY``: a JSON list of tensor names, :func:`input_scales_metadata`). A checkpoint
that stores some scales and not others loads as saved when the record of every shard is the
same, names every scale stored and none of those missing: the missing layers had no scale
when saved. A scale that was saved and then lost is in the record and not in the file:
refused, as before. A checkpoint without the record (saved before it existed, or rewritten
by a tool that dropped the metadata) follows the rule above.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.modules.fp8_linear import Fp8Linear
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer.new_layers import loaded_names
from hf_fp8.quantizer.validation import checkpoint_file
from hf_fp8.utils.safetensors_header import _header_fits

# the safetensors metadata key naming the input scales a save stored (a JSON list)
RECORD_KEY = "hf_fp8_input_scales"


def model_input_scales(model: nn.Module) -> list[str]:
    """The tensor names of every static input scale ``model`` has (``<linear>.input_scale``,
    ``<experts>.<proj>_input_scale``), as ``save_pretrained`` stores them."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) and module.activation_scheme == "static":
            if module.input_scale is not None:
                names.append(f"{name}.input_scale")
        elif isinstance(module, Fp8Experts) and module.recipe.is_static:
            for proj in module.layout.projections:
                if getattr(module, f"{proj}_input_scale") is not None:
                    names.append(f"{name}.{proj}_input_scale")
    return sorted(names)


def input_scales_metadata(model: nn.Module) -> dict[str, str]:
    """``{RECORD_KEY: JSON list}`` of the input scales ``model`` saves, for the metadata of
    each shard ``save_pretrained`` writes (``Fp8HfQuantizer.get_state_dict_and_metadata``);
    ``{}`` for a model without static layers."""
    static = any(
        (isinstance(m, Fp8Linear) and m.activation_scheme == "static")
        or (isinstance(m, Fp8Experts) and m.recipe.is_static)
        for m in model.modules()
    )
    return {RECORD_KEY: json.dumps(model_input_scales(model))} if static else {}


# A record names each stored input scale once: ~1 MB for 10,000 names. Longer is not a record
# an hf-fp8 save wrote (a hostile one cost ~8x its size in memory per shard when parsed: R36).
MAX_RECORD_CHARS = 8 << 20


def _file_record_text(path: str) -> str | None:
    """The raw record in the safetensors file ``path``'s metadata; None: none, unreadable or
    longer than ``MAX_RECORD_CHARS``."""
    try:
        if not path.endswith(".safetensors") or not _header_fits(path):
            return None
        with safe_open(path, "pt") as f:
            value = (f.metadata() or {}).get(RECORD_KEY)
    except (OSError, SafetensorError, ValueError):
        return None
    return value if isinstance(value, str) and len(value) <= MAX_RECORD_CHARS else None


def _parse_record(text: str) -> set[str] | None:
    try:
        names = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return set(names)


def saved_record(files: Sequence[str]) -> set[str] | None:
    """The input scales the save of ``files`` recorded: the same record in every file, else
    (one lacks it, two differ, a ``.bin``, one too long) None. The raw texts are compared
    and only one is parsed (a save writes the same text into every shard)."""
    first: str | None = None
    for f in files:
        text = _file_record_text(str(f))
        if text is None or (first is not None and text != first):
            return None
        first = text
    return None if first is None else _parse_record(first)


class StoredInputScales:
    """Which static input scales the checkpoint stores (``stored``) and which it does not
    (``unfilled``; ``offloaded_unfilled``: those of layers offloaded to disk), collected over
    every ``Fp8Linear`` / ``Fp8Experts`` after loading. ``names``: the checkpoint's tensor
    names (``kept_modules.file_tensor_names``); ``None`` when unknown (a ``.bin`` checkpoint),
    then a loaded tensor counts as stored, and an offloaded one too."""

    def __init__(self, names: set[str] | None = None, files: Sequence[str] = ()) -> None:
        self.names = names
        self.files = list(files)  # the checkpoint files read: their saved record
        self._stripped: set[str] | None = None
        self._keys: set[str] = set()  # every input scale the model has
        self._maybe_renamed: list[str] = []  # offloaded, not stored under their own name
        self.stored: list[str] = []
        self.unfilled: list[str] = []
        self.offloaded_unfilled: list[str] = []
        self._loaded: dict[str, torch.Tensor] = {}  # values read from the checkpoint

    def add(self, key: str, param: Any, *, offloaded: bool) -> None:
        """Record the input scale ``key`` (``param``: the module's tensor, ``None`` when the
        layer has none; ``offloaded``: the layer's tensors stay on disk)."""
        if param is None:
            return
        self._keys.add(key)
        loaded = not offloaded and getattr(param, "_is_hf_initialized", False)
        if loaded:
            self._loaded[key] = param
        if self.names is not None:
            stored = loaded or self._in_checkpoint(key)
            if offloaded and not stored:  # stored under a renamed module? decided in check()
                self._maybe_renamed.append(key)
                return
        else:
            stored = offloaded or loaded
        self._record(key, stored, offloaded)

    def _record(self, key: str, stored: bool, offloaded: bool) -> None:
        if stored:
            self.stored.append(key)
            return
        self.unfilled.append(key)
        if offloaded:
            self.offloaded_unfilled.append(key)

    def _in_checkpoint(self, key: str) -> bool:
        """``key`` is a stored tensor name, also across the base-model prefix a loader adds
        or strips (``model.`` of a ``*ForCausalLM`` saved from its base model and back)."""
        if self._stripped is None:
            self._stripped = {_strip(n) for n in self.names or () if "." in n}
        names = self.names or set()
        return key in names or key in self._stripped or _strip(key) in names

    def _resolve_renamed(self) -> None:
        """An offloaded layer may be stored under another module name (Mixtral saves its
        experts as ``block_sparse_moe``, the model calls them ``mlp``): a stored input scale
        that no module of the model claims under its own name, with the same name up to the
        layer index (``model.layers.1``) and the same last two parts
        (``experts.down_proj_input_scale``). ``encoder.block.1`` is not ``decoder.block.1``,
        and a block's own ``EncDecAttention.q`` is not its ``SelfAttention.q`` (reviewer R7)."""
        keys = self._keys | {_strip(k) for k in self._keys}
        free = [
            n
            for n in self.names or ()
            if n.endswith("input_scale") and n not in keys and _strip(n) not in keys
        ]
        # across the base-model prefix too (``model.`` on one side only, as _in_checkpoint)
        full = {_layer_and_leaf(n) for n in free}
        either = full | {_layer_and_leaf(_strip(n)) for n in free}
        for key in self._maybe_renamed:
            found = _layer_and_leaf(key) in either or _layer_and_leaf(_strip(key)) in full
            self._record(key, found, offloaded=True)
        self._maybe_renamed = []

    def check(self, checkpoint_root: str, config: Any) -> None:
        """Raise ``CheckpointTensorError`` naming the missing scales when the checkpoint
        stored some input scales but not these, or stores none for a layer offloaded to disk."""
        self._resolve_renamed()
        fallback = getattr(config, "activation_scale", None)
        if self.stored and self.unfilled and not self._config_given_only(config):
            lost = self._lost_by_record()
            if lost is None:
                return  # the save recorded exactly these scales: loads as saved
            self._refuse_partial(checkpoint_root, fallback, lost)
        if self.offloaded_unfilled:
            self._refuse_offloaded(checkpoint_root, fallback)

    def _config_given_only(self, config: Any) -> bool:
        """The stored scales are exactly the config's ``activation_scales`` (names and values)
        and there is no fallback: the checkpoint of a model saved before calibration with
        scales given for some layers, complete as it is."""
        scales = getattr(config, "activation_scales", None) or {}
        if not scales or getattr(config, "activation_scale", None) is not None:
            return False
        # across the base-model prefix too (``model.`` on one side only, as _in_checkpoint)
        given = {**{_strip(k): v for k, v in scales.items() if "." in k}, **scales}
        if any(_given_value(key, given) is not None for key in self.unfilled):
            return False  # a scale the config gave was saved and lost
        for key in self.stored:
            value = _given_value(key, given)
            if value is None:
                return False  # a scale no config gave: calibrated, the others lost
            loaded = self._loaded.get(key)  # offloaded: on disk, not read here
            if loaded is not None and not _all_equal(loaded, value):
                return False  # calibrated over the given value
        return True

    def check_shared(self, model: nn.Module) -> None:
        """Refuse different input scales stored for one module shared under several names.

        A module shared by two parents (``layers[1].mlp.experts = layers[0].mlp.experts``)
        has one input scale; a checkpoint saved from the unshared model may store one under
        each name, and the loader writes every one into the same tensor: the one it reads
        last wins, silently. Equal stored values load; different ones raise
        ``CheckpointTensorError`` naming both keys (the rule ``activation_scales`` follows,
        ``hf_fp8.modules.replace.shared_scale``). A name is found as the loader finds it:
        the model's own, across the base-model prefix, or renamed by the model's conversion
        mapping (Mixtral stores ``block_sparse_moe.experts``, the model calls it
        ``mlp.experts``: reviewer R32 F1)."""
        if self.names is None:
            return
        aliases: dict[int, tuple[nn.Module, list[str]]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            if isinstance(module, (Fp8Linear, Fp8Experts)):
                aliases.setdefault(id(module), (module, []))[1].append(name)
        shared: list[tuple[list[str], list[str]]] = []
        for module, names in aliases.values():
            if len(names) < 2:
                continue
            if isinstance(module, Fp8Linear):
                leaves = [".input_scale"]
            else:
                leaves = [f".{proj}_input_scale" for proj in module.layout.projections]
            shared += [([f"{n}{leaf}" for n in names], names) for leaf in leaves]
        if not shared:
            return
        renamed = self._renamed_into(model, {key for keys, _ in shared for key in keys})
        for keys, names in shared:
            self._check_one_shared(keys, names, renamed)

    def _renamed_into(self, model: nn.Module, keys: set[str]) -> dict[str, list[str]]:
        """``{model key: stored names}`` for the stored input scales that no tensor of
        ``model`` has under its own name and that the loader renames into one of ``keys``
        (``hf_fp8.quantizer.new_layers.loaded_names``: the model's conversion mapping, then
        the base-model prefix)."""
        own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        own |= {_strip(n) for n in own if "." in n}
        leaves = {key.rpartition(".")[2] for key in keys}
        out: dict[str, list[str]] = {}
        for name in sorted(self.names or ()):
            if name.rpartition(".")[2] not in leaves or name in own or _strip(name) in own:
                continue
            loaded = loaded_names(model, [name])
            target = next(iter(loaded)) if len(loaded) == 1 else None
            if target in keys:
                out.setdefault(target, []).append(name)
        return out

    def _check_one_shared(
        self, keys: list[str], names: list[str], renamed: dict[str, list[str]]
    ) -> None:
        stored: list[tuple[str, str]] = []
        for key in keys:
            own = self._stored_name(key)
            found = [own] if own is not None else []
            found += [n for n in renamed.get(key, ()) if n not in found]
            stored += [(key, name) for name in found]
        if len(stored) < 2:
            return
        values = [(key, name, _read_tensor(self.files, name)) for key, name in stored]
        values = [(key, name, v) for key, name, v in values if v is not None]
        first_key, first_name, first = values[0] if values else ("", "", None)
        for key, name, value in values[1:]:
            if value.shape != first.shape or not torch.equal(value, first):
                where = (
                    f" (stored as {first_name} and {name})"
                    if (first_name, name) != (first_key, key)
                    else ""
                )
                raise CheckpointTensorError(
                    f"{first_key} and {key}: the checkpoint stores different input scales "
                    f"({_brief(first)} and {_brief(value)}){where} for one module shared under "
                    f"the names {names}: a shared module has one input scale, and the loader "
                    "would keep whichever it reads last. Keep one of these tensors in the "
                    "checkpoint, or give them the same value (e.g. calibrate the shared model "
                    "and save_pretrained it)"
                )

    def _stored_name(self, key: str) -> str | None:
        """The checkpoint's name for the model's tensor ``key`` (across the base-model
        prefix), or None: not stored under it."""
        names = self.names or set()
        if key in names:
            return key
        if _strip(key) in names:
            return _strip(key)
        prefixed = [n for n in names if "." in n and _strip(n) == key]
        return prefixed[0] if len(prefixed) == 1 else None

    def _lost_by_record(self) -> list[str] | None:
        """None when the save's record says the checkpoint is complete as it is (it names
        every stored scale and none of the missing ones); else the missing scales it names
        (``[]``: no record, or a stored scale it does not name)."""
        record = saved_record(self.files) if self.names is not None else None
        if record is None:
            return []
        stripped = {_strip(n) for n in record if "." in n}

        def recorded(key: str) -> bool:  # across the base-model prefix too
            return key in record or key in stripped or _strip(key) in record

        lost = [key for key in self.unfilled if recorded(key)]
        if lost or not all(recorded(key) for key in self.stored):
            return lost
        return None

    def _refuse_partial(self, checkpoint_root: str, fallback: Any, lost: list[str]) -> None:
        if lost:
            source = checkpoint_file(checkpoint_root, self.stored[0])
            raise CheckpointTensorError(
                f"{lost[0]}: the static checkpoint {source} lacks {len(lost)} input_scale "
                f"tensor(s) ({_shown(lost)}) that its save recorded as stored (the "
                f"{RECORD_KEY} metadata of its shards): they were lost after saving, and "
                "these layers would run without their saved scale. Save the model again "
                "(save_pretrained), or restore these tensors"
            )
        shown = _shown(self.unfilled)
        instead = (
            f"the config's fallback activation_scale={fallback}"
            if fallback is not None
            else "no scale at all (they would ask for calibration)"
        )
        source = checkpoint_file(checkpoint_root, self.stored[0])
        raise CheckpointTensorError(
            f"{self.unfilled[0]}: the static checkpoint {source} lacks {len(self.unfilled)} "
            f"input_scale tensor(s) ({shown}) while it stores {len(self.stored)} others, "
            "and these are not exactly the config's activation_scales; the missing layers "
            f"would run with {instead} instead of their saved scale. Save the calibrated model "
            "again (hf_fp8.calibrate, then save_pretrained), or restore these tensors; a "
            "checkpoint saved with scales on some layers only (Fp8Config(activation_scales="
            "{...}), or set_input_scale) by this hf_fp8 version reloads as saved, so save the "
            "model again with it; to use the fallback on purpose, remove every input_scale "
            "from the checkpoint"
        )

    def _refuse_offloaded(self, checkpoint_root: str, fallback: Any) -> None:
        keys = self.offloaded_unfilled
        instead = (
            f"the config's fallback activation_scale={fallback}"
            if fallback is not None
            else "a calibrated scale"
        )
        raise CheckpointTensorError(
            f"{keys[0]}: {len(keys)} layer(s) offloaded to disk ({_shown(keys)}) have no "
            f"input_scale in the static checkpoint {checkpoint_root or 'being loaded'} (saved "
            "before calibration). An offloaded layer reads every tensor from the checkpoint at "
            f"forward time, so it cannot use {instead}. Calibrate and save it first "
            "(load it without disk offload, hf_fp8.calibrate, save_pretrained) and load that "
            "with this device_map, or keep these layers in memory (device_map 'cpu' instead "
            "of 'disk')"
        )


def _read_tensor(files: Sequence[str], name: str) -> torch.Tensor | None:
    """Tensor ``name`` of the first safetensors file of ``files`` that stores it."""
    for file in files:
        path = str(file)
        try:
            if not path.endswith(".safetensors") or not _header_fits(path):
                continue
            with safe_open(path, "pt") as f:
                if name in f.keys():  # noqa: SIM118 (a safe_open handle)
                    return f.get_tensor(name)
        except (OSError, SafetensorError, ValueError):
            continue
    return None


def _brief(t: torch.Tensor) -> str:
    values = t.detach().float().flatten().tolist()
    shown = ", ".join(f"{v:.6g}" for v in values[:4]) + (" …" if len(values) > 4 else "")
    return f"[{shown}]"


def _given_value(key: str, given: dict[str, float]) -> float | None:
    """The config's scale for the input scale tensor ``key`` (``<linear>.input_scale``, or
    ``<experts>.<projection>_input_scale``), also across the base-model prefix."""
    module = key.removesuffix(".input_scale")
    if module == key:
        module = key.removesuffix("_input_scale")
    value = given.get(module)
    return value if value is not None else given.get(_strip(module))


def _all_equal(t: torch.Tensor, value: float) -> bool:
    """Every element of ``t`` is ``value`` as float32 (``set_input_scale`` stores it so)."""
    t = t.detach()
    if t.is_meta:
        return True
    return bool((t.float() == torch.tensor(value, dtype=torch.float32)).all())


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (" …" if len(keys) > 5 else "")


def _strip(name: str) -> str:
    """``name`` without its first part (the base-model prefix a loader adds or strips)."""
    return name.split(".", 1)[-1]


def _layer_and_leaf(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the name up to and including its first numeric part, the last two parts)."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return (tuple(parts[: i + 1]) if i is not None else (), tuple(parts[-2:]))
