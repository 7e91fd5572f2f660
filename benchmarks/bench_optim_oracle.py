"""What dominates the update-direction error of ``AdamWFp8``? Oracle shadows (issue 15).

The training run of :mod:`bench_optim_fidelity` (fp32 AdamW on the small stdlib-text Llama)
feeds its gradients to *simulated* quantized optimizers: fp32 AdamW whose stored moments are
rounded after every step by an emulated format (any mantissa width, round-to-nearest or
stochastic, COAT expansion or plain absmax, any group size), or kept exact. Each moment is
chosen on its own, so "m exact + v quantized" and the reverse separate the two sources.
The emulation uses exact ``log2`` / ``exp2`` (not the package's kernels): it measures formats,
not code. Reported: the accumulated update-direction error (same definition as the fidelity
benchmark: shadows restart from the reference parameters every step) averaged over the 50
steps before step 300 (and 1000 when run that long), and the one-shot error.

    python benchmarks/bench_optim_oracle.py --steps 300      # optim_oracle.json

**Storage budget** (``optim_oracle_budget.json``): every variant also reports the bits per
parameter its state would take (:func:`state_bits`): code bits (``log2`` of the number of
codes, so a fractional width means an (m, v) pair packed in one mixed-radix code) plus the
per-group scales. New spec keys, usable on any moment:

- ``"fmt": "mlog"`` with ``"codes": C``: unsigned Mitchell-log codes ``0..C`` (``log2(C+1)``
  bits: ``C = 511`` is 9 bits, ``360`` is 8.5 bits), ``"steps"`` codes per octave at ``k = 1``
  (default ``(C+1)/16``: 16 octaves at ``k = 1``, as ``mlog16u``);
- ``"fmt": "int"`` with ``"levels": L``: linear absmax codes ``-L..L`` (``log2(2L+1)`` bits;
  ``L = 127`` is ``int8``, ``181`` is 8.5 bits);
- ``"scale"``: how the group's maximum is stored, rounded *up* to its grid: ``"f32"`` (32
  bits, exact: every older variant), ``"l16"`` (16 bits, 1/256 octave), ``"l10q16"`` (10
  bits, 1/16 octave: 64 octaves with an offset per tensor), ``"l8q4"`` (8 bits, 1/4 octave:
  64 octaves), ``"l8q32"`` (1/32 octave: counted as 8 bits, but not clamped, and the codes
  used spanned 11 bits), ``"e8"`` (8 bits, whole octaves: an E8M0 exponent as in OCP MX);
  for ``mlog`` the grid is in Mitchell's log (whole octaves = powers of two);
- ``"kbits"``: COAT's ``k = j/16`` stored in that many bits (``k <= (2^kbits - 1)/16``;
  without it ``k`` counts 32 bits, clamped to 1024 as before).

Names of the budget variants: ``mnorm_i<L>`` / ``v_ml<C>`` for the new widths, then the
rounding (``ld``), the scale (``s8q4``, ``e8k8`` = e8 scale + 8-bit k) and ``g<N>`` (group).
The scale codes each run used are recorded (``scale_codes``: smallest and largest, to check
that they fit their bits).

    python benchmarks/bench_optim_oracle.py --steps 300 --variants <budget variants> \
        --output <file>      # runs merged in optim_oracle_budget.json (its "commands")
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_optim_fidelity as fid  # noqa: E402

# Unsigned / signed 8-bit float grids: mantissa bits, smallest normal exponent, largest value.
FORMATS = {
    "e4m3": (3, -6, 448.0),  # float8_e4m3fn (sign bit used by m)
    "e4m4u": (4, -6, 496.0),  # unsigned: the sign bit of a v >= 0 becomes a mantissa bit
    "e5m3u": (3, -14, 61440.0),  # unsigned: the sign bit becomes an exponent bit
    "e3m5u": (5, -2, 252.0),
    "e3m4": (4, -2, 31.0),  # signed, bias 3
    "e2m5": (5, 0, 7.875),  # signed, bias 1
}
# Mitchell-log codes: magnitude code c in [1, C] uniform in L(x) = E + mu (the float's bit
# pattern read as a number), S codes per octave at k = 1; 0 = zero.
MLOG = {"mlog8": (127, 8), "mlog16u": (255, 16)}
# How a group's maximum is stored: (bits, grid step in octaves); rounded up to the grid.
SCALES = {
    "f32": (32, 0.0),
    "l16": (16, 1 / 256),
    "l10q16": (10, 1 / 16),  # 64 octaves, with an offset per tensor (see scale_codes)
    "l8q4": (8, 0.25),  # 64 octaves
    # 8 octaves: NOT enough for m / sqrt(v) as emulated (no clamp): its group maxima spanned
    # 2^-43..2^3 in optim_oracle_budget.json (rows whose m decayed); 11 bits at 1/32 octave
    "l8q32": (8, 1 / 32),
    "e8": (8, 1.0),
}
# Smallest / largest scale code seen, per "variant:moment" (filled by the oracle run).
SCALE_CODES: dict[str, list[float]] = {}


def store_scale(lg: torch.Tensor, spec: dict[str, Any], tag: str | None) -> torch.Tensor:
    """The log2 (Mitchell's for mlog) of a group's maximum as stored: rounded up to the grid
    of ``spec["scale"]`` (unchanged for f32). ``lg``: finite entries for non-zero groups."""
    step = SCALES[spec.get("scale", "f32")][1]
    if step == 0:
        return lg
    j = torch.ceil(lg / step)
    if tag is not None:
        real = j[lg.abs() < 1e8]
        if real.numel():
            lo, hi = SCALE_CODES.setdefault(tag, [math.inf, -math.inf])
            SCALE_CODES[tag] = [min(lo, float(real.min())), max(hi, float(real.max()))]
    return j * step


def k_max(spec: dict[str, Any]) -> float:
    return (2 ** spec["kbits"] - 1) / 16 if "kbits" in spec else 1024.0


def code_bits(spec: dict[str, Any] | None) -> float:
    """Bits per element of one moment's codes (fractional: packed with the other moment)."""
    if spec is None:
        return 32.0
    if spec["fmt"] == "mlog":
        return math.log2(spec["codes"] + 1)
    if spec["fmt"] == "int":
        return math.log2(2 * spec["levels"] + 1)
    return 8.0


def scale_bits(spec: dict[str, Any] | None) -> float:
    """Bits per element of one moment's group scales (max, and k where the format has one)."""
    if spec is None:
        return 0.0
    per_group = SCALES[spec.get("scale", "f32")][0]
    fmt = spec["fmt"]
    if fmt in MLOG or fmt == "mlog" or (fmt in FORMATS and spec.get("expand", True)):
        per_group += spec.get("kbits", 32)
    return per_group / spec.get("gs", 128)


def state_bits(mspec: dict | None, vspec: dict | None) -> dict[str, float]:
    """Bits per parameter of a variant's optimizer state (codes + scales)."""
    codes = code_bits(mspec) + code_bits(vspec)
    total = codes + scale_bits(mspec) + scale_bits(vspec)
    return {
        "m_code_bits": round(code_bits(mspec), 4),
        "v_code_bits": round(code_bits(vspec), 4),
        "m_scale_bits": round(scale_bits(mspec), 4),
        "v_scale_bits": round(scale_bits(vspec), 4),
        "bits_per_param": round(total, 4),
        "pair_packed_bits_per_param": round(math.ceil(codes - 1e-9) + total - codes, 4),
        "bytes_per_param": round(total / 8, 4),
    }


def mitchell_log(x: torch.Tensor) -> torch.Tensor:
    fr, ex = torch.frexp(x.double())
    return (ex - 1).double() + (2 * fr - 1)


def mitchell_exp(lg: torch.Tensor) -> torch.Tensor:
    e = torch.floor(lg)
    return torch.ldexp(1 + (lg - e), e.to(torch.int32)).float()


PHI = 0.6180339887498949  # golden ratio: frac(base + t * PHI) is low-discrepancy in t
_LD_BASES: dict[tuple, torch.Tensor] = {}  # TimeLowDiscrepancy's bases: the same every step


class TimeLowDiscrepancy:
    """Stochastic-rounding thresholds ``frac(base + t * PHI)``: uniform per element and step
    like independent draws, but evenly spread over consecutive steps of one element, so
    the rounding errors of a slowly moving moment cancel over time instead of adding up as
    a random walk. ``base``: fixed random per (parameter, moment), reproducible."""

    def __init__(self, t: int, key: int) -> None:
        self.t, self.key = t, key

    def rand(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        cache_key = (self.key, tuple(shape), dtype)
        base = _LD_BASES.get(cache_key)
        if base is None:
            gen = torch.Generator().manual_seed(self.key)
            base = _LD_BASES[cache_key] = torch.rand(shape, generator=gen, dtype=dtype)
        return torch.frac(base + (self.t * PHI) % 1.0)


def uniform(gen: Any, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Independent draws from a ``torch.Generator``, or ``gen.rand`` (time low-discrepancy)."""
    if isinstance(gen, torch.Generator):
        return torch.rand(shape, generator=gen, dtype=dtype)
    return gen.rand(shape, dtype)


def round_grid(y: torch.Tensor, fmt: str, u: torch.Tensor | None) -> torch.Tensor:
    """Round magnitudes ``y >= 0`` to the grid of ``fmt`` (``u``: uniform noise = stochastic)."""
    mbits, emin, fmax = FORMATS[fmt]
    _, exp = torch.frexp(y)
    e = (exp - 1).clamp(min=emin).float()
    ulp = torch.exp2(e - mbits)
    r = y / ulp
    q = torch.floor(r + u) if u is not None else torch.round(r)
    return (q * ulp).clamp(max=fmax)


def roundtrip(
    x: torch.Tensor, spec: dict[str, Any], gen: torch.Generator, tag: str | None = None
) -> torch.Tensor:
    """``x`` (``[rows, cols]``) stored in ``spec``'s format and read back (fp32)."""
    fmt, gs = spec["fmt"], spec.get("gs", 128)
    rows, cols = x.shape
    if cols % gs:  # groups longer than a row: of the flattened tensor, zero-padded
        flat = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % gs))
        out = roundtrip(flat.view(-1, gs), spec, gen, tag).reshape(-1)
        return out[: x.numel()].view(rows, cols)
    if fmt in MLOG or fmt == "mlog":
        return mlog_roundtrip(x, spec, gen, tag)
    if fmt in ("int8", "int"):  # linear absmax, 127 (or "levels") levels a sign
        levels = spec.get("levels", 127)
        xg = x.reshape(rows, cols // gs, gs).float()
        amax = xg.abs().amax(-1, keepdim=True)
        if spec.get("scale", "f32") != "f32":
            lg = torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)).double())
            lg = torch.where(amax > 0, lg, torch.full_like(lg, 1e9))
            amax = torch.where(amax > 0, torch.exp2(store_scale(lg, spec, tag)).float(), amax)
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        y = xg.abs() / safe * levels
        u = uniform(gen, xg.shape) if spec.get("sr") else None
        q = torch.floor(y + u) if u is not None else torch.round(y)
        return (torch.sign(xg) * q * safe / levels).reshape(rows, cols)
    fmax = FORMATS[fmt][2]
    xg = x.reshape(rows, cols // gs, gs).float()
    ax = xg.abs()
    amax = ax.amax(-1, keepdim=True)
    u = uniform(gen, xg.shape) if spec.get("sr") else None
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if spec.get("expand", True):
        amin = torch.where(ax > 0, ax, torch.full_like(ax, math.inf)).amin(-1, keepdim=True)
        lr = torch.log2(safe) - torch.log2(torch.where(torch.isinf(amin), safe, amin))
        target = spec.get("range", 2 * math.log2(fmax) - 1)
        k = torch.where(lr > 0, torch.floor(16 * target / lr.clamp(min=1e-30)) / 16, 1.0)
        k = k.clamp(1 / 16, 1024)
        y = fmax * torch.exp2(k * (torch.log2(ax.clamp(min=1e-38)) - torch.log2(safe)))
        y = torch.where(ax > 0, y, torch.zeros_like(y))
        q = round_grid(y, fmt, u)
        out = safe * torch.exp2(torch.log2(q.clamp(min=1e-38) / fmax) / k)
        out = torch.where(q > 0, out, torch.zeros_like(out))
    else:
        q = round_grid(ax / safe * fmax, fmt, u)
        out = q * safe / fmax
    return (torch.sign(xg) * out).reshape(rows, cols)


def mlog_roundtrip(
    x: torch.Tensor, spec: dict[str, Any], gen: torch.Generator, tag: str | None = None
) -> torch.Tensor:
    if spec["fmt"] == "mlog":
        cmax = spec["codes"]
        steps = spec.get("steps", (cmax + 1) / 16)
    else:
        cmax, steps = MLOG[spec["fmt"]]
    gs = spec.get("gs", 128)
    rows, cols = x.shape
    xg = x.reshape(rows, cols // gs, gs).float()
    ax = xg.abs()
    nz = ax > 0
    lx = mitchell_log(torch.where(nz, ax, torch.ones_like(ax)))
    lmax = torch.where(nz, lx, torch.full_like(lx, -1e9)).amax(-1, keepdim=True)
    lmin = torch.where(nz, lx, torch.full_like(lx, 1e9)).amin(-1, keepdim=True)
    lmax = store_scale(lmax, spec, tag)  # all-zero groups (lmax = -1e9) store zeros anyway
    lr = (lmax - lmin).clamp(min=0)
    span = cmax - 2 if spec.get("snap") else cmax - 1  # snapping may cost one code
    k = torch.where(lr > 0, torch.floor(16 * span / steps / lr.clamp(min=1e-30)) / 16, 1.0)
    k = k.clamp(1 / 16, k_max(spec))
    if spec.get("snap"):  # the grid at fixed points j / (steps k): it moves only when k does
        lmax = torch.ceil(lmax * steps * k) / (steps * k)
    t = cmax + steps * k * (lx - lmax)
    c = torch.floor(t + uniform(gen, t.shape, t.dtype)) if spec.get("sr") else torch.round(t)
    c = c.clamp(0, cmax)
    keep = nz & (c > 0)
    out = mitchell_exp(lmax + (c - cmax) / (steps * k))
    out = torch.where(keep, out, torch.zeros_like(out))
    return (torch.sign(xg) * out).reshape(rows, cols)


# m / v spec: None = exact fp32. v specs may add "sqrt": True (store sqrt(v)).
E4 = {"fmt": "e4m3"}
VARIANTS: dict[str, tuple[dict | None, dict | None]] = {
    "exact": (None, None),
    "m_rtn|v_exact": (E4, None),
    "m_sr|v_exact": ({**E4, "sr": True}, None),
    "m_plain|v_exact": ({**E4, "expand": False}, None),
    "m_rtn_g64|v_exact": ({**E4, "gs": 64}, None),
    "m_rtn_g32|v_exact": ({**E4, "gs": 32}, None),
    "m_exact|v_rtn": (None, E4),
    "m_exact|v_sr": (None, {**E4, "sr": True}),
    "m_exact|v_e4m4u_rtn": (None, {"fmt": "e4m4u"}),
    "m_exact|v_e4m4u_sr": (None, {"fmt": "e4m4u", "sr": True}),
    "m_exact|v_e5m3u_sr": (None, {"fmt": "e5m3u", "sr": True}),
    "m_exact|v_sqrt_e4m4u_sr": (None, {"fmt": "e4m4u", "sr": True, "sqrt": True}),
    "m_exact|v_sqrt_e4m4u_rtn": (None, {"fmt": "e4m4u", "sqrt": True}),
    "m_rtn|v_sr": (E4, {**E4, "sr": True}),  # today's default
    "m_rtn|v_e4m4u_sr": (E4, {"fmt": "e4m4u", "sr": True}),
    "m_rtn|v_e4m4u_rtn": (E4, {"fmt": "e4m4u"}),
    "m_mlog8|v_exact": ({"fmt": "mlog8"}, None),
    "m_int8|v_exact": ({"fmt": "int8"}, None),
    "m_e3m4|v_exact": ({"fmt": "e3m4", "expand": False}, None),
    "m_e2m5|v_exact": ({"fmt": "e2m5", "expand": False}, None),
    "m_e3m4x|v_exact": ({"fmt": "e3m4"}, None),
    "mnorm_int8|v_exact": ({"fmt": "int8", "norm": True}, None),
    "mnorm_e3m4|v_exact": ({"fmt": "e3m4", "expand": False, "norm": True}, None),
    "mnorm_e2m5|v_exact": ({"fmt": "e2m5", "expand": False, "norm": True}, None),
    "mnorm_mlog8|v_exact": ({"fmt": "mlog8", "norm": True}, None),
    "m_exact|v_mlog16u_rtn": (None, {"fmt": "mlog16u"}),
    "m_exact|v_mlog16u_sr": (None, {"fmt": "mlog16u", "sr": True}),
    "mnorm_int8|v_mlog16u_sr": ({"fmt": "int8", "norm": True}, {"fmt": "mlog16u", "sr": True}),
    "mnorm_int8|v_mlog16u_rtn": ({"fmt": "int8", "norm": True}, {"fmt": "mlog16u"}),
    "mnorm2_int8|v_exact": ({"fmt": "int8", "norm": "pow2"}, None),
    "mnorm2_int8|v_mlog16u_sr": ({"fmt": "int8", "norm": "pow2"}, {"fmt": "mlog16u", "sr": True}),
    "mnorm2_int8_g64|v_mlog16u_sr": (
        {"fmt": "int8", "norm": "pow2", "gs": 64},
        {"fmt": "mlog16u", "sr": True},
    ),
    "mnorm2_e2m5|v_mlog16u_sr": (
        {"fmt": "e2m5", "expand": False, "norm": "pow2"},
        {"fmt": "mlog16u", "sr": True},
    ),
    "m_mlog8|v_mlog16u_sr": ({"fmt": "mlog8"}, {"fmt": "mlog16u", "sr": True}),
    # stochastic rounding with thresholds low-discrepancy in time ("ld", TimeLowDiscrepancy)
    "m_exact|v_mlog16u_ld": (None, {"fmt": "mlog16u", "sr": "ld"}),
    "m_exact|v_sr_ld": (None, {**E4, "sr": "ld"}),
    "m_exact|v_e4m4u_ld": (None, {"fmt": "e4m4u", "sr": "ld"}),
    "mnorm2_int8|v_mlog16u_ld": ({"fmt": "int8", "norm": "pow2"}, {"fmt": "mlog16u", "sr": "ld"}),
    "mnorm2_int8_ld|v_mlog16u_ld": (
        {"fmt": "int8", "norm": "pow2", "sr": "ld"},
        {"fmt": "mlog16u", "sr": "ld"},
    ),
    "m_rtn|v_sr_ld": (E4, {**E4, "sr": "ld"}),
    # "snap": the group's grid at fixed points (the largest code rounded up to one)
    "m_exact|v_mlog16u_sr_snap": (None, {"fmt": "mlog16u", "sr": True, "snap": True}),
    "m_exact|v_mlog16u_ld_snap": (None, {"fmt": "mlog16u", "sr": "ld", "snap": True}),
    "mnorm2_int8_ld|v_mlog16u_ld_snap": (
        {"fmt": "int8", "norm": "pow2", "sr": "ld"},
        {"fmt": "mlog16u", "sr": "ld", "snap": True},
    ),
    "mnorm_int8_ld|v_mlog16u_ld_snap": (
        {"fmt": "int8", "norm": True, "sr": "ld"},
        {"fmt": "mlog16u", "sr": "ld", "snap": True},
    ),
    "mnorm_int8_ld|v_mlog16u_ld": (
        {"fmt": "int8", "norm": True, "sr": "ld"},
        {"fmt": "mlog16u", "sr": "ld"},
    ),
}


def _m(levels: int, scale: str = "f32", gs: int = 128) -> dict[str, Any]:
    """m / sqrt(stored v), linear absmax codes -levels..levels, ld rounding."""
    return {"fmt": "int", "levels": levels, "norm": True, "sr": "ld", "scale": scale, "gs": gs}


def _v(codes: int, scale: str = "f32", kbits: int | None = None, gs: int = 128) -> dict:
    """v as unsigned Mitchell-log codes 0..codes, ld rounding."""
    spec = {"fmt": "mlog", "codes": codes, "sr": "ld", "scale": scale, "gs": gs}
    return spec if kbits is None else {**spec, "kbits": kbits}


# Budget study (optim_oracle_budget.json): unequal widths, cheap scales, packed pairs.
VARIANTS.update(
    {
        # one moment alone, the other exact: error against width
        "m_exact|v_ml511_ld": (None, _v(511)),  # 9 bits
        "m_exact|v_ml1023_ld": (None, _v(1023)),  # 10 bits
        "m_exact|v_ml360_ld": (None, _v(360)),  # 8.5 bits
        "m_exact|v_ml511_ld_e8k8": (None, _v(511, "e8", 8)),
        "mnorm_i63_ld|v_exact": (_m(63), None),  # 7 bits
        "mnorm_i127_ld|v_exact": (_m(127), None),  # 8 bits
        "mnorm_i181_ld|v_exact": (_m(181), None),  # 8.5 bits
        "mnorm_i255_ld|v_exact": (_m(255), None),  # 9 bits
        "mnorm_i127_ld_s8q4|v_exact": (_m(127, "l8q4"), None),
        # pairs within 17.2 bits (2.15 bytes) a parameter
        "mnorm_i127_ld_s8q4|v_ml511_ld_e8k8": (_m(127, "l8q4"), _v(511, "e8", 8)),  # 8 + 9
        "mnorm_i63_ld_s8q4|v_ml1023_ld_e8k8": (_m(63, "l8q4"), _v(1023, "e8", 8)),  # 7 + 10
        "mnorm_i255_ld_s8q4|v_mlog16u_ld_e8k8": (  # 9 + 8
            _m(255, "l8q4"),
            {"fmt": "mlog16u", "sr": "ld", "scale": "e8", "kbits": 8},
        ),
        "mnorm_i181_ld_s8q4|v_ml360_ld_e8k8": (_m(181, "l8q4"), _v(360, "e8", 8)),  # 8.5 + 8.5
        "mnorm_i181_ld_s8q4_g64|v_ml360_ld_e8k8_g256": (
            _m(181, "l8q4", 64),
            _v(360, "e8", 8, 256),
        ),
        "mnorm_i127_ld_s8q4_g64|v_ml511_ld_e8k8_g256": (
            _m(127, "l8q4", 64),
            _v(511, "e8", 8, 256),
        ),
        "mnorm_i215_ld_s8q4|v_ml303_ld_e8k8": (_m(215, "l8q4"), _v(303, "e8", 8)),  # 8.75 + 8.25
        # finer scales in 8 + 17 bits a group (m's spans a few octaves)
        "mnorm_i181_ld_s8q32|v_ml360_ld_l10q16k7": (_m(181, "l8q32"), _v(360, "l10q16", 7)),
        # pairs with exact fp32 scales (over budget: what the cheap scales cost)
        "mnorm_i127_ld|v_ml511_ld": (_m(127), _v(511)),
        "mnorm_i181_ld|v_ml360_ld": (_m(181), _v(360)),
        # diagnostics of the scale cost: k clamped to 8 bits alone; 8/10-bit maxima alone
        "mnorm_i181_ld|v_ml360_ld_k8": (_m(181), _v(360, "f32", 8)),
        "mnorm_i181_ld_s8q32|v_ml360_ld_l10q16": (_m(181, "l8q32"), _v(360, "l10q16")),
    }
)


def store_m(
    m: torch.Tensor, v_stored: torch.Tensor, spec: dict | None, gen, tag: str | None = None
) -> torch.Tensor:
    """m as stored; ``spec["norm"]``: m / sqrt(stored v) is quantized (scaled back here)."""
    if spec is None:
        return m
    rows = m.shape[0]
    if not spec.get("norm"):
        return roundtrip(m.reshape(rows, -1), spec, gen, tag).view_as(m)
    r = v_stored.sqrt()
    if spec["norm"] == "pow2":  # 2^floor(log2 sqrt(v)): exact scaling, no division
        _, e = torch.frexp(r)
        r = torch.where(r > 0, torch.ldexp(torch.ones_like(r), e - 1), torch.zeros_like(r))
    safe = torch.where(r > 0, r, torch.ones_like(r))
    mn = torch.where(r > 0, m / safe, torch.zeros_like(m))
    return roundtrip(mn.reshape(rows, -1), spec, gen, tag).view_as(m) * r


class OracleShadows:
    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.params = [p for p in model.parameters() if p.dim() >= 2 and p.numel() >= 4096]
        self.names = names
        self.m = {n: [torch.zeros_like(p) for p in self.params] for n in names}
        self.v = {n: [torch.zeros_like(p) for p in self.params] for n in names}
        self.err: dict[str, list[float]] = {n: [] for n in names}
        self.gen = torch.Generator().manual_seed(0)
        self.t = 0

    def step(self, start: list[torch.Tensor], lr: float) -> None:
        """After the reference step: each shadow's update from ``start`` against the reference."""
        self.t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        ref = [p.detach() - s for p, s in zip(self.params, start, strict=True)]
        ref_norm = math.sqrt(sum(float(r.double().pow(2).sum()) for r in ref))
        for name in self.names:
            mspec, vspec = VARIANTS[name]
            diff = 0.0
            for i, (p, s) in enumerate(zip(self.params, start, strict=True)):
                g = p.grad.float()
                rows = p.shape[0]
                m = self.m[name][i] * b1 + (1 - b1) * g
                v = self.v[name][i] * b2 + (1 - b2) * g * g
                upd = -lr * fid.WD * s - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
                diff += float((upd - ref[i]).double().pow(2).sum())
                vgen, mgen = (
                    TimeLowDiscrepancy(self.t, 2 * i + j) if s_.get("sr") == "ld" else self.gen
                    for j, s_ in enumerate((vspec or {}, mspec or {}))
                )
                if vspec is None:
                    self.v[name][i] = v
                elif vspec.get("sqrt"):
                    root = roundtrip(v.sqrt().reshape(rows, -1), vspec, vgen)
                    self.v[name][i] = (root * root).view_as(v)
                else:
                    vq = roundtrip(v.reshape(rows, -1), vspec, vgen, f"{name}:v")
                    self.v[name][i] = vq.view_as(v)
                self.m[name][i] = store_m(m, self.v[name][i], mspec, mgen, f"{name}:m")
            self.err[name].append(math.sqrt(diff) / ref_norm)


def one_shot(params: list[torch.Tensor], opt: torch.optim.Optimizer, names: list[str]) -> dict:
    gen = torch.Generator().manual_seed(1)
    out = {}
    for name in names:
        mspec, vspec = VARIANTS[name]
        num = den = 0.0
        for p in params:
            m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
            rows = p.shape[0]
            u = m / (v.sqrt() + 1e-8)
            if vspec is None:
                vq = v
            elif vspec.get("sqrt"):
                vq = roundtrip(v.sqrt().reshape(rows, -1), vspec, gen).view_as(v) ** 2
            else:
                vq = roundtrip(v.reshape(rows, -1), vspec, gen).view_as(v)
            root = vq.sqrt()
            mq = store_m(m, vq, mspec, gen)
            num += float((mq / (root + 1e-8) - u).double().pow(2).sum())
            den += float(u.double().pow(2).sum())
        out[name] = math.sqrt(num / den)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--output", type=Path, default=fid.RESULTS / "optim_oracle.json")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    tokens, vocab = fid.corpus_tokens((args.steps + fid.EVAL_BATCHES) * fid.BATCH * fid.SEQ)
    batches = tokens[: (len(tokens) // (fid.BATCH * fid.SEQ)) * fid.BATCH * fid.SEQ]
    data = batches.view(-1, fid.BATCH, fid.SEQ)[: -fid.EVAL_BATCHES]
    model = fid.make_model(vocab)
    opt = fid.make_optimizer("adamw_fp32", model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fid.lr_lambda(args.steps))
    shadows = OracleShadows(model, args.variants)
    for step in range(args.steps):
        batch = data[step % len(data)]
        model(input_ids=batch, labels=batch).loss.backward()
        lr = opt.param_groups[0]["lr"]
        start = [p.detach().clone() for p in shadows.params]
        opt.step()
        shadows.step(start, lr)
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % 50 == 0:
            at = {n: round(sum(e[-50:]) / 50, 4) for n, e in shadows.err.items()}
            print(step + 1, json.dumps(at), flush=True)
    summary: dict[str, Any] = {"one_shot": one_shot(shadows.params, opt, args.variants)}
    for at in (300, 1000):
        if args.steps >= at:
            summary[f"update_rel_error_at_{at}"] = {
                n: sum(e[at - fid.WINDOW : at]) / fid.WINDOW for n, e in shadows.err.items()
            }
    results = {
        "command": "python benchmarks/bench_optim_oracle.py " + " ".join(argv or sys.argv[1:]),
        "steps": args.steps,
        "formats": FORMATS,
        "variants": {n: VARIANTS[n] for n in args.variants},
        "bits": {n: state_bits(*VARIANTS[n]) for n in args.variants},
        "scale_codes": {k: v for k, v in SCALE_CODES.items() if k.split(":")[0] in args.variants},
        "threads": torch.get_num_threads(),
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
        "summary": summary,
        "curves": {n: [round(x, 5) for x in e] for n, e in shadows.err.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary, indent=1))
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
