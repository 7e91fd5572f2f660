"""``torch._scaled_mm`` on CUDA GPUs with FP8 tensor cores (compute capability >= 8.9).

Contract (torch 2.x): ``a`` [M, K] row-major fp8, ``b`` [K, N] column-major fp8, K and N
multiples of 16; scales fp32, either both scalars (tensor-wise, any output dtype) or
``[M, 1]`` and ``[1, N]`` (row-wise, bf16 output). At most one operand may be e5m2.
"""

from __future__ import annotations

import torch

from hf_fp8.kernels.capability import has_fp8_gemm


def unsupported_reason(
    device: torch.device,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    act_granularity: str,
    weight_granularity: str,
) -> str | None:
    """Why ``_scaled_mm`` cannot run this product, or ``None`` when it can."""
    if not has_fp8_gemm(device):
        return (
            f"torch._scaled_mm needs a CUDA GPU with compute capability >= 8.9; the input is on "
            f"{device}"
        )
    if act_dtype == weight_dtype == torch.float8_e5m2:
        return "torch._scaled_mm cannot multiply two e5m2 operands; use fp8_format='e4m3'"
    if "block" in (act_granularity, weight_granularity):
        return "block-wise scales run on the emulated kernel"
    rowwise = "row" in (act_granularity, weight_granularity)
    if rowwise and out_dtype != torch.bfloat16:
        return f"row-wise torch._scaled_mm only writes bfloat16, not {out_dtype}; load in bfloat16"
    return None


def _pad_to_16(t: torch.Tensor, dim: int) -> torch.Tensor:
    pad = (-t.shape[dim]) % 16
    if not pad:
        return t
    widths = [0, 0] * (t.dim() - dim - 1) + [0, pad]
    # F.pad cannot pad fp8: pad the raw bytes (fp8 zero is the zero byte).
    return torch.nn.functional.pad(t.view(torch.uint8), widths).view(t.dtype)


def scaled_mm_linear(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a_fp8 * a_scale) @ (w_fp8 * w_scale).T + bias`` on FP8 tensor cores.

    ``a_fp8`` is [M, K]; ``a_scale`` is [1] or [M, 1]; ``w_scale`` is [1] or [N, 1].
    """
    m, n = a_fp8.shape[0], w_fp8.shape[0]
    a, w = _pad_to_16(a_fp8, 1), _pad_to_16(_pad_to_16(w_fp8, 1), 0)
    a_scale, w_scale = a_scale.float(), w_scale.float()
    if a_scale.numel() == 1 and w_scale.numel() == 1:
        sa, sb = a_scale.reshape(()), w_scale.reshape(())
    else:
        sa = a_scale.reshape(-1, 1).expand(m, 1).contiguous()
        sb = w_scale.reshape(1, -1).expand(1, n)
        sb = torch.nn.functional.pad(sb, (0, w.shape[0] - n), value=1.0).contiguous()
    out = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    out = out[:, :n]
    return out if bias is None else out + bias.to(out_dtype)
