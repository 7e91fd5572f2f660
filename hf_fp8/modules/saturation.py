"""A cheap saturation counter for static FP8 layers (issue 12 §6).

A static ``input_scale`` that is too small clips every activation above
``input_scale * fp8_max`` to ±max without a word. One eager forward in
``SaturationCounter.sample_every`` of a static layer adds the number of clipped elements to a
device tensor (no host sync; saturation is a property of the data, a sample shows it); every
``check_every`` sampled calls one sync reads it, and when more than
``SaturationCounter.warn_fraction`` of the activations seen were clipped, one warning per
layer names it. Under ``torch.compile`` nothing is counted (no graph break, no extra work).
Set ``SaturationCounter.check_every = 0`` to switch it off.

Only finite values count as clipped (R38 F6): a NaN / inf activation becomes a NaN code at
any scale (its token's output is NaN), so it says nothing about the scale. Such inputs are
counted apart, and the first check that finds any warns once per layer with its own advice
(find where the model produces them; calibrating again does not help).

The counts belong to one input scale: a new scale (``set_input_scale``, ``calibrate``, a
``load_state_dict`` copying into it) starts the count again, warning included (R27 F5).

Grad modes (R31 F8, F10): a scale that is an inference tensor (a model loaded under
``torch.inference_mode()``) has no version counter, so only a new tensor restarts its count;
the count itself is accumulated out of place, so a count started under ``inference_mode``
keeps counting outside it (an inference tensor cannot be updated in place there). Inputs
under a ``torch.func`` transform (``vmap``, ``grad``) are not counted: their count would
outlive the transform.
"""

from __future__ import annotations

import warnings

import torch

from hf_fp8.kernels.cpu_linear import functorch_active


class SaturationCounter:
    """Counts the activations a static layer clips; warns once when they are too many."""

    sample_every = 8  # count one forward in this many (the others cost one int increment)
    check_every = 16  # sampled calls between two host reads of the counter (0: counting off)
    warn_fraction = 1e-3  # a percentile calibration clips ~1e-4 on purpose

    def __init__(self) -> None:
        self.forwards = 0
        self.calls = 0  # sampled forwards
        self.elements = 0
        self.clipped: torch.Tensor | None = None  # int64 on the activations' device
        self.nonfinite: torch.Tensor | None = None  # NaN / inf inputs, int64 as ``clipped``
        self.warned = False
        self.warned_nonfinite = False
        self._scale: torch.Tensor | None = None  # the scale the counts were taken under
        self._scale_version = -1

    def reset(self) -> None:
        """Forget the counts (and the warning): the input scale changed."""
        self.forwards = self.calls = self.elements = 0
        self.clipped = self.nonfinite = None
        self.warned = self.warned_nonfinite = False

    def _follow(self, input_scale: torch.Tensor) -> None:
        """Reset when ``input_scale`` is another tensor, or was changed in place, since the
        last call (identity and version counter: no host sync)."""
        version = -1 if input_scale.is_inference() else input_scale._version
        if input_scale is not self._scale or version != self._scale_version:
            if self._scale is not None:
                self.reset()
            self._scale, self._scale_version = input_scale, version

    def update(self, x: torch.Tensor, input_scale: torch.Tensor, fp8_max: float, name: str) -> None:
        if not self.check_every or x.numel() == 0 or functorch_active():
            return
        self._follow(input_scale)
        if self.warned:  # said once: no more reads (a NaN later goes unreported, as before)
            return
        self.forwards += 1
        if (self.forwards - 1) % self.sample_every:
            return
        limit = input_scale.detach().float() * fp8_max
        mag = x.detach().float().abs()
        finite = mag.isfinite()
        clipped = (finite & (mag > limit)).sum()  # NaN / inf: not the scale's doing
        nonfinite = finite.numel() - finite.sum()
        if self.clipped is None or self.clipped.device != clipped.device:
            self.clipped, self.nonfinite = clipped, nonfinite
        else:  # out of place: the count may be an inference tensor, this call outside it
            self.clipped = self.clipped + clipped
            self.nonfinite = self.nonfinite + nonfinite
        self.elements += x.numel()
        self.calls += 1
        if self.calls % self.check_every == 0:
            self.check(name, float(input_scale.detach().float().max()))

    def fraction(self) -> float:
        """Fraction of the activations seen that were clipped (one host sync)."""
        if self.clipped is None or not self.elements:
            return 0.0
        return int(self.clipped) / self.elements

    def nonfinite_count(self) -> int:
        """NaN / inf activations seen (one host sync); not counted as clipped."""
        return 0 if self.nonfinite is None else int(self.nonfinite)

    def check(self, name: str, scale: float) -> None:
        if not self.warned_nonfinite:
            bad = self.nonfinite_count()
            if bad:
                self.warned_nonfinite = True
                warnings.warn(
                    f"hf_fp8: static FP8 layer {name or '(unnamed)'}: {bad} of {self.elements} "
                    f"activations over {self.calls} sampled calls were non-finite (NaN or inf), "
                    "and their tokens' outputs are NaN at any "
                    "input_scale, so calibrating again does not help. Find where the model "
                    "produces them: a layer before this one overflowing its dtype (float16: run "
                    "in bfloat16), a NaN in the inputs or an attention mask, or a corrupted "
                    "weight",
                    RuntimeWarning,
                    stacklevel=4,
                )
        if self.warned:
            return
        fraction = self.fraction()
        if fraction > self.warn_fraction:
            self.warned = True
            warnings.warn(
                f"hf_fp8: static FP8 layer {name or '(unnamed)'} clipped {fraction:.2%} of its "
                f"activations over {self.calls} sampled calls (input_scale={scale:.3g} is too small "
                "for the data): re-calibrate with hf_fp8.calibrate on representative batches, "
                "or use activation_scheme='dynamic'",
                RuntimeWarning,
                stacklevel=4,
            )
