"""Static input scales of a pre-quantized load: all stored, or none.

A static checkpoint saved before calibration stores no ``input_scale``: its layers take the
config's ``activation_scale`` (or ask for ``hf_fp8.calibrate``). One saved after calibration
stores them all. A checkpoint with some of them and not the others lost tensors: the missing
layers would quietly run with the config's fallback instead of their calibrated scale
(reviewer R2: calibrated 0.000202 came back 0.05, outputs 1.6 % off), so it is refused.
"""

from __future__ import annotations

from typing import Any

from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer.validation import checkpoint_file


class StoredInputScales:
    """Which static input scales the checkpoint filled (``stored``) and which it did not
    (``unfilled``), collected over every ``Fp8Linear`` / ``Fp8Experts`` after loading."""

    def __init__(self) -> None:
        self.stored: list[str] = []
        self.unfilled: list[str] = []

    def add(self, key: str, param: Any, *, offloaded: bool) -> None:
        """Record the input scale ``key`` (``param``: the module's tensor, ``None`` when the
        layer has none). An offloaded layer's tensors stay on disk: counted as stored."""
        if param is None:
            return
        if offloaded or getattr(param, "_is_hf_initialized", False):
            self.stored.append(key)
        else:
            self.unfilled.append(key)

    def check(self, checkpoint_root: str, config: Any) -> None:
        """Raise ``CheckpointTensorError`` naming the missing scales when the checkpoint
        stored some input scales but not these."""
        if not (self.stored and self.unfilled):
            return
        shown = ", ".join(self.unfilled[:5]) + (" …" if len(self.unfilled) > 5 else "")
        fallback = getattr(config, "activation_scale", None)
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
