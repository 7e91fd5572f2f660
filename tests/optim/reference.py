"""Plain float64 references for the optimizer tests (written independently of hf_fp8)."""

from __future__ import annotations

import math

import numpy as np
import torch

FLT_MIN = 2.0**-126
K_MIN, K_MAX = 1.0 / 16.0, 1024.0
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def coat_reference(x: np.ndarray, fmax: float) -> tuple[np.ndarray, np.ndarray]:
    """COAT as written in the paper, in float64, per row: centre c, scale s, exponent k.

    Returns the exact pre-rounding fp8 value ``sign(x)·(|x|/c)^k / s`` and ``k``.
    """
    out, ks = np.zeros(x.shape, dtype=np.float64), np.ones(x.shape[0])
    for i, row in enumerate(x.astype(np.float64)):
        a = np.abs(row)
        nz = a[a >= FLT_MIN]
        if nz.size == 0:
            continue
        big, small = nz.max(), nz.min()
        c = math.sqrt(big) * math.sqrt(small)
        if big == small:
            k = 1.0
        else:
            k = math.floor(16 * math.log2(fmax**2 / 2) / math.log2(big / small)) / 16
            k = min(max(k, K_MIN), K_MAX)
        s = (big / c) ** k / fmax
        with np.errstate(divide="ignore"):
            out[i] = np.where(a >= FLT_MIN, np.sign(row) * (a / c) ** k / s, 0.0)
        ks[i] = k
    return out, ks


def dequant_reference(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
    """float64 ``sign(q)·amax·(|q|/F)^(1/k)`` (``q·scale`` without ``k``), groups on the last dim."""
    qd = q.double()
    if k is None:
        return qd * scale.double().unsqueeze(-1)
    fmax = FMAX[q.dtype]
    amax = scale.double().unsqueeze(-1) * fmax
    return torch.sign(qd) * amax * (qd.abs() / fmax) ** (1.0 / k.double().unsqueeze(-1))


def adamw_reference(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step in float64 (decoupled weight decay, bias correction); returns p, m, v."""
    b1, b2 = betas
    p, g, m, v = (t.double() for t in (p, g, m, v))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat = m / (1 - b1**step)
    v_hat = v / (1 - b2**step)
    p = p * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)
    return p, m, v


# ---------------------------------------------------------------- moment_format="log"
def mitchell_log(x: np.ndarray) -> np.ndarray:
    """Mitchell's log2 of positive ``x``: ``E + mu`` for ``x = 2^E·(1 + mu)`` (float64)."""
    fr, ex = np.frexp(x.astype(np.float64))
    return (ex - 1) + (2.0 * fr - 1.0)


def mitchell_exp(lg: np.ndarray) -> np.ndarray:
    """Inverse of :func:`mitchell_log`."""
    e = np.floor(lg)
    return np.ldexp(1.0 + (lg - e), e.astype(np.int64))


def log_v_dequant_reference(
    codes: torch.Tensor, amax: torch.Tensor, k: torch.Tensor
) -> torch.Tensor:
    """float64 ``v̂``: codes uniform in Mitchell's log, 16·k codes per octave below amax."""
    c = codes.double().numpy()
    a = amax.double().numpy()[..., None]
    kk = k.double().numpy()[..., None]
    with np.errstate(divide="ignore"):
        lg = mitchell_log(np.where(a > 0, a, 1.0)) + (c - 255.0) / (16.0 * kk)
    out = np.where((c > 0) & (a > 0) & (lg >= -126), mitchell_exp(lg), 0.0)
    return torch.from_numpy(out)


def log_m_exponent(codes_v: torch.Tensor, amax: torch.Tensor, k: torch.Tensor) -> np.ndarray:
    """``e`` of the m normalization as documented, in float32 numpy:
    ``max(floor(c·slope + L(amax)/2 - 255·slope), -63)``, ``slope = 2^-5 / k``."""
    c = codes_v.numpy().astype(np.float32)
    slope = (np.float32(2.0**-5) / k.numpy().astype(np.float32))[..., None]
    bits = amax.numpy().astype(np.float32).view(np.int32).astype(np.int64)
    half_log = ((bits - 0x3F800000).astype(np.float32) * np.float32(2.0**-24))[..., None]
    offset = (half_log - slope * np.float32(255.0)).astype(np.float32)
    h = (c * slope).astype(np.float32) + offset
    return np.maximum(np.floor(h.astype(np.float32)), -63.0).astype(np.float64)


def log_m_dequant_reference(
    codes: torch.Tensor, scale: torch.Tensor, e: np.ndarray
) -> torch.Tensor:
    """float64 ``m̂ = q · scale · 2^e``."""
    return torch.from_numpy(codes.double().numpy() * scale.double().numpy()[..., None] * 2.0**e)


def log_v_quant_reference(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pre-rounding codes ``255 + 16·k·(L(v) - L(amax))`` (0 for v = 0) and ``k`` per row."""
    t, ks = np.zeros(v.shape), np.ones(v.shape[0])
    for i, row in enumerate(v.astype(np.float64)):
        nz = row[row >= FLT_MIN]
        if nz.size == 0:
            continue
        lmax, lmin = mitchell_log(nz.max()), mitchell_log(nz.min())
        k = 1.0 if lmax == lmin else math.floor(254.0 / (lmax - lmin)) / 16
        k = min(max(k, K_MIN), K_MAX)
        with np.errstate(divide="ignore"):
            t[i] = np.where(row >= FLT_MIN, 255 + 16 * k * (mitchell_log(row) - lmax), 0.0)
        ks[i] = k
    return t, ks


def log_m_quant_reference(m: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Pre-rounding int8 codes of ``m·2^-e``, absmax 127 per row."""
    mn = m.astype(np.float64) * 2.0**-e
    amax = np.abs(mn).max(axis=1, keepdims=True)
    return np.where(amax > 0, mn / np.where(amax > 0, amax, 1.0) * 127.0, 0.0)
