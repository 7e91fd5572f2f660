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
"""

from __future__ import annotations

from typing import Any

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
        self._layer_leaves: set[tuple[tuple[str, ...], tuple[str, ...]]] | None = None
        self.stored: list[str] = []
        self.unfilled: list[str] = []
        self.offloaded_unfilled: list[str] = []

    def add(self, key: str, param: Any, *, offloaded: bool) -> None:
        """Record the input scale ``key`` (``param``: the module's tensor, ``None`` when the
        layer has none; ``offloaded``: the layer's tensors stay on disk)."""
        if param is None:
            return
        loaded = not offloaded and getattr(param, "_is_hf_initialized", False)
        if self.names is not None:
            # An offloaded layer may be stored under another module name (Mixtral saves its
            # experts as ``block_sparse_moe``, the model calls them ``mlp``): matched by its
            # layer index and its last two name parts.
            stored = loaded or self._in_checkpoint(key) or (offloaded and self._renamed(key))
        else:
            stored = offloaded or loaded
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
            self._stripped = {n.split(".", 1)[1] for n in self.names or () if "." in n}
        names = self.names or set()
        return key in names or key in self._stripped or key.split(".", 1)[-1] in names

    def _renamed(self, key: str) -> bool:
        """``key`` is stored under a renamed module: a stored input scale with the same layer
        (``layers.1``) and the same last two name parts (``experts.down_proj_input_scale``)."""
        if self._layer_leaves is None:
            self._layer_leaves = {
                _layer_and_leaf(n) for n in self.names or () if n.endswith("input_scale")
            }
        return _layer_and_leaf(key) in self._layer_leaves

    def check(self, checkpoint_root: str, config: Any) -> None:
        """Raise ``CheckpointTensorError`` naming the missing scales when the checkpoint
        stored some input scales but not these, or stores none for a layer offloaded to disk."""
        fallback = getattr(config, "activation_scale", None)
        if self.stored and self.unfilled:
            self._refuse_partial(checkpoint_root, fallback)
        if self.offloaded_unfilled:
            self._refuse_offloaded(checkpoint_root, fallback)

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
            f"input_scale tensor(s) ({shown}) while it stores {len(self.stored)} others "
            f"(calibrated); the missing layers would run with {instead} instead of their "
            "calibrated scale. Save the calibrated model again (hf_fp8.calibrate, then "
            "save_pretrained), or restore these tensors; to use the fallback on purpose, "
            "remove every input_scale from the checkpoint"
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


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (" …" if len(keys) > 5 else "")


def _layer_and_leaf(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the segment before the first numeric part and that part, the last two parts)."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return (tuple(parts[i - 1 : i + 1]) if i else (), tuple(parts[-2:]))
