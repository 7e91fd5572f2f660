"""``torch._scaled_mm`` on CUDA GPUs with FP8 tensor cores (compute capability >= 8.9).

Contract (torch 2.13, ``_meta_registrations._check_scaled_mm_sizes`` and
``aten/src/ATen/native/cuda/ScaledBlas.cpp``):

* ``a`` [M, K] row-major fp8, ``b`` [K, N] column-major fp8 (the transposed view of a
  contiguous [N, K] weight); K and N multiples of 16 (M is free); not both e5m2.
* tensor-wise: both scales fp32 with one element (any high-precision output dtype);
  row-wise: contiguous fp32 ``scale_a`` [M, 1] and ``scale_b`` [1, N]. The CUTLASS
  row-wise kernel (sm89, and sm90 with cuBLAS < 12.9) writes bfloat16 only and needs an
  e4m3 ``b``: both are required here, whatever the build.
* ``bias`` [N] in the output dtype (bf16 or fp16), added to the fp32 accumulator before
  the final rounding; not allowed with fp32 output (then added afterwards).
* ``use_fast_accum=False``: full fp32 accumulation on Hopper, as the emulation does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_fp8.kernels.capability import has_fp8_gemm
from hf_fp8.recipe import Granularity

# Plain strings (the recipe's words): compared per call, also under torch.compile.
_BLOCK, _ROW = Granularity.BLOCK.value, Granularity.ROW.value
# Output dtypes whose bias torch._scaled_mm adds itself (fp32 output rejects a bias).
_FUSED_BIAS_DTYPES = (torch.bfloat16, torch.float16)


def unsupported_reason(
    device: torch.device,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    act_granularity: str,
    weight_granularity: str,
) -> str | None:
    """Why ``_scaled_mm`` cannot run this product, or ``None`` when it can (granularities are
    numerics layouts, :class:`hf_fp8.recipe.Granularity`)."""
    if device.type == "cuda" and torch.version.hip is not None:
        return (
            "torch._scaled_mm on ROCm takes the *_fnuz fp8 dtypes, not hf_fp8's OCP "
            "float8_e4m3fn / e5m2; the emulated kernel runs instead"
        )
    if not has_fp8_gemm(device):
        return (
            f"torch._scaled_mm needs a CUDA GPU with compute capability >= 8.9; the input is on "
            f"{device}"
        )
    if act_dtype == weight_dtype == torch.float8_e5m2:
        return "torch._scaled_mm cannot multiply two e5m2 operands; use fp8_format='e4m3'"
    if _BLOCK in (act_granularity, weight_granularity):
        return "block-wise scales run on the emulated kernel"
    rowwise = _ROW in (act_granularity, weight_granularity)
    if rowwise and out_dtype != torch.bfloat16:
        return f"row-wise torch._scaled_mm only writes bfloat16, not {out_dtype}; load in bfloat16"
    if rowwise and weight_dtype != torch.float8_e4m3fn:
        return f"row-wise torch._scaled_mm needs an e4m3 weight, not {weight_dtype}"
    return None


def _pad_to_16(t: torch.Tensor, dim: int) -> torch.Tensor:
    pad = (-t.shape[dim]) % 16
    if not pad:
        return t
    widths = [0, 0] * (t.dim() - dim - 1) + [0, pad]
    # F.pad cannot pad fp8: pad the raw bytes (fp8 zero is the zero byte).
    return F.pad(t.view(torch.uint8), widths).view(t.dtype)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with strides ``(cols, 1)``: ``.contiguous()`` alone keeps e.g. the ``(1, 1)``
    strides of a one-row transposed view, which ``_scaled_mm``'s layout check rejects."""
    if t.stride() == (t.shape[1], 1):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def scaled_mm_linear(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a_fp8 * a_scale) @ (w_fp8 * w_scale).T + bias`` on FP8 tensor cores.

    ``a_fp8`` is [M, K]; ``a_scale`` is [1] or [M, 1]; ``w_fp8`` is [N, K]; ``w_scale`` is
    [1] or [N, 1]. K and N are zero-padded to multiples of 16 (padded weight rows get scale
    1 and bias 0, and are sliced off). Returns a contiguous [M, N] tensor in ``out_dtype``.
    """
    m, n = a_fp8.shape[0], w_fp8.shape[0]
    # Row-major operands: a non-contiguous activation (a transposed input) or weight (a
    # GPT-2 Conv1D weight quantized through its transpose) would break the layout rule.
    a = _row_major(_pad_to_16(a_fp8, 1))
    w = _row_major(_pad_to_16(_pad_to_16(w_fp8, 1), 0))
    n_pad = w.shape[0]
    a_scale, w_scale = a_scale.float(), w_scale.float()
    if a_scale.numel() == 1 and w_scale.numel() == 1:
        sa, sb = a_scale.reshape(()), w_scale.reshape(())
    else:  # row-wise; a tensor-wise side is broadcast to its row shape
        sa = a_scale.reshape(-1, 1).expand(m, 1).contiguous()
        sb = w_scale.reshape(1, -1).expand(1, n)
        if n_pad != n:
            sb = F.pad(sb, (0, n_pad - n), value=1.0)
        sb = sb.contiguous()
    fused_bias = None
    if bias is not None and out_dtype in _FUSED_BIAS_DTYPES:
        fused_bias = bias.to(out_dtype)
        if n_pad != n:
            fused_bias = F.pad(fused_bias, (0, n_pad - n))
        fused_bias = fused_bias.contiguous()
    out = torch._scaled_mm(
        a,
        w.t(),
        scale_a=sa,
        scale_b=sb,
        bias=fused_bias,
        out_dtype=out_dtype,
        use_fast_accum=False,
    )
    if n_pad != n:
        out = out[:, :n].contiguous()
    if bias is not None and fused_bias is None:
        out = out + bias.to(out_dtype)
    return out
