"""Reference products and error bounds shared by the kernel and module tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_fp8.numerics import dequantize, quantize
from hf_fp8.recipe import ActivationGranularity

E4M3 = torch.float8_e4m3fn


def fake_quant(x: torch.Tensor, granularity: str, block_k: int = 128, dtype=E4M3):
    """fp32 ``dequantize(quantize(x))`` of an activation ``[..., K]``."""
    gran = ActivationGranularity(granularity).layout.value  # "token" is per row
    block = (1, block_k)
    x_fp8, scale = quantize(x, dtype, gran, block)
    return dequantize(x_fp8, scale, torch.float32, gran, block)


@dataclass
class Reference:
    """Exact (float64) ``a @ w.T + bias``, ``|a @ w.T|`` and the sum of |terms|."""

    out: torch.Tensor
    mm_abs: torch.Tensor
    abs_sum: torch.Tensor


def reference_linear(
    a_fp32: torch.Tensor, w_fp32: torch.Tensor, bias: torch.Tensor | None
) -> Reference:
    a, w = a_fp32.double(), w_fp32.double()
    mm = a @ w.T
    bias_d = torch.zeros(()) if bias is None else bias.double()
    return Reference(mm + bias_d, mm.abs(), a.abs() @ w.abs().T + bias_d.abs())


# bounds per compute dtype, relative to (|result|, |a @ w.T|, sum |terms|):
BOUNDS = {
    # fp32 accumulation, bf16 rounding of the product, then of the scaled result + bias
    torch.bfloat16: (2.0**-7, 2.0**-8, 2.0**-16),
    torch.float16: (2.0**-9, 0.0, 2.0**-9),  # scales folded into fp16 operands
    torch.float32: (2.0**-20, 0.0, 2.0**-18),
}


# block scales vary along K, so they are folded into the operands: one bf16 rounding each
BOUNDS_FOLDED = {**BOUNDS, torch.bfloat16: (2.0**-7, 2.0**-8, 2.0**-8)}


def assert_close_to_reference(
    out: torch.Tensor,
    ref: Reference,
    dtype: torch.dtype,
    *,
    ref_rounded: bool = False,
    folded: bool = False,
    fp8_tensor_cores: bool = False,
) -> None:
    """``|out - ref| <= r1 |ref| + r2 |a @ w.T| + r3 sum|terms|`` elementwise.

    ``r1`` covers the roundings of the result, ``r2`` one rounding of the product before
    its scales and bias are applied, ``r3`` the operands and a reordered fp32
    accumulation. Folding the scales into bf16 operands, or accumulating in bf16, breaks
    the bound where a product nearly cancels. ``ref_rounded``: ``ref.out`` was itself
    rounded to ``dtype`` (doubles ``r1``). ``folded``: block scales were folded into the
    operands. ``fp8_tensor_cores``: ``out`` comes from a GPU FP8 gemm, whose tensor cores
    keep about 14 bits while they add up a K-block (``use_fast_accum=False`` only promotes
    the partial sums to fp32 between blocks): ``r3`` is raised to ``2**-12``.
    """
    r1, r2, r3 = (BOUNDS_FOLDED if folded else BOUNDS)[dtype]
    r1 = 2 * r1 if ref_rounded else r1
    r3 = max(r3, 2.0**-12) if fp8_tensor_cores else r3
    assert out.shape == ref.out.shape
    err = (out.double() - ref.out).abs()
    bound = r1 * ref.out.abs() + r2 * ref.mm_abs + r3 * ref.abs_sum + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error reaches {worst:.2f}x the bound"
