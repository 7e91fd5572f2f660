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
"""

from __future__ import annotations

from typing import Any

import torch

from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer.validation import checkpoint_file


class StoredInputScales:
    """Which static input scales the checkpoint stores (``stored``) and which it does not
    (``unfilled``; ``offloaded_unfilled``: those of layers offloaded to disk), collected over
    every ``Fp8Linear`` / ``Fp8Experts`` after loading. ``names``: the checkpoint's tensor
    names (``kept_modules.file_tensor_names``); ``None`` when unknown (a ``.bin`` checkpoint),
    then a loaded tensor counts as stored, and an offloaded one too."""

    def __init__(self, names: set[str] | None = None) -> None:
        self.names = names
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
            self._refuse_partial(checkpoint_root, fallback)
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

    def _refuse_partial(self, checkpoint_root: str, fallback: Any) -> None:
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
            "again (hf_fp8.calibrate, then save_pretrained), or restore these tensors; scales "
            "set on some layers only belong in Fp8Config(activation_scales={...}) before "
            "saving; to use the fallback on purpose, remove every input_scale from the "
            "checkpoint"
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
