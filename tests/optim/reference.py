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
