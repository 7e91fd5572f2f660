"""Fast FP8 emulation: decode the fp8 operands, multiply in the compute dtype.

The path for CPUs and for GPUs without FP8 tensor cores. It never calls the CPU
``torch._scaled_mm`` (tensor-wise scales go through oneDNN there and are thousands of
times slower than a bf16 matmul) and gives ``_scaled_mm``'s numbers on the same quantized
operands: every fp8 value is exact in bf16, fp16 and fp32, products are accumulated in
fp32, and tensor / row scales are applied to the fp32 accumulator rather than folded into
the operands (``(a_fp8 @ w_fp8.T) * a_scale * w_scale``) in bf16, as ``_scaled_mm`` does.
What is added is rounding to the compute dtype. The GEMV (few tokens, here and in the C
kernels) scales the fp32 sum, adds the bias and rounds once. Above it a bf16 matmul (torch's,
or the C kernels' fused GEMM) rounds the unscaled fp32 sum to bf16 first, and the epilogue
rounds again after the scales and bias: ``bf16(bf16(acc) * scale + bias)``, as torch's bf16
``F.linear`` followed by a scale would; up to about one bf16 ulp from the correctly rounded
result, so one token's bf16 output may differ by that between batch sizes (one side of the
GEMV limit or the other). The scales are folded into the operands before the matmul for
block scales (they vary along K), for fp32 compute (exact enough, and bit-equal to the CPU
``_scaled_mm``) and for fp16 compute (unscaled fp8 products, up to 448² · K, overflow
fp16); the matmul's result is then rounded to the compute dtype as a plain one is.

Shapes: ``x`` is ``[..., K]`` (``M`` tokens), ``w_fp8`` ``[N, K]``. Up to
``GEMV_MAX_TOKENS`` tokens on CPU, a fused decode-and-reduce (GEMV) reads and decodes each
fp8 weight element once for all tokens and never materialises the decoded weight; above,
the weight is decoded to the compute dtype in one vectorized pass and a normal matmul
runs. Both are inductor-compiled (``hf_fp8.kernels.compiled``), with an eager twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_fp8.kernels import compiled, cpu_kernel, cpu_linear
from hf_fp8.numerics import amax, amax_to_scale, dequantize, quantize_with_scale
from hf_fp8.recipe import Granularity

# At or below this many tokens the fused decode + reduction beats decode + matmul on CPU
# (benchmarks/bench_linear.py --gemv-sweep on an AVX-512 EPYC core: the GEMV is ahead up to
# 8 tokens at K=2048 and up to 4 at K=5632, behind from 6). Each token count up to it
# compiles its own GEMV once.
GEMV_MAX_TOKENS = 4
# The recipe's scale layouts as plain strings (compared per call, also under torch.compile).
_BLOCK = Granularity.BLOCK.value
_PER_TENSOR_OR_ROW = (Granularity.TENSOR.value, Granularity.ROW.value)


def post_scaled(granularity: str | None, dtype: torch.dtype) -> bool:
    """Whether a tensor / row scale is applied to the accumulator instead of the operand."""
    return granularity in _PER_TENSOR_OR_ROW and dtype == torch.bfloat16


def _act_scale(
    x: torch.Tensor, input_scale: torch.Tensor | None, act_dtype: torch.dtype, gran: str, bk: int
) -> torch.Tensor:
    if input_scale is not None:
        return input_scale.float()
    return amax_to_scale(amax(x, gran, (1, bk)), act_dtype)


def _quantize_act(
    x: torch.Tensor,
    input_scale: torch.Tensor | None,
    *,
    act_dtype: torch.dtype,
    gran: str,
    bk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 activation and its scale (static when ``input_scale`` is given)."""
    scale = _act_scale(x, input_scale, act_dtype, gran, bk)
    return quantize_with_scale(x, scale, act_dtype, gran, (1, bk)), scale


def _fake_quant_act(
    x: torch.Tensor,
    input_scale: torch.Tensor | None,
    *,
    act_dtype: torch.dtype,
    gran: str,
    bk: int,
    out_dtype: torch.dtype,
    post: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Activation operand in ``out_dtype``: fp8 values (``post``; scale returned) or
    dequantized values (scale folded in; ``None`` returned)."""
    x_fp8, scale = _quantize_act(x, input_scale, act_dtype=act_dtype, gran=gran, bk=bk)
    if post:
        return x_fp8.float().to(out_dtype), scale
    return dequantize(x_fp8, scale, out_dtype, gran, (1, bk)), None


def _decode_weight(
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    dtype: torch.dtype,
    gran: str,
    block_size: tuple[int, int],
    post: bool,
) -> torch.Tensor:
    """The weight in ``dtype``: fp8 values (``post``) or dequantized values."""
    if post:
        return w_fp8.float().to(dtype)  # via fp32: inductor vectorizes fp8 → fp32 only
    return dequantize(w_fp8, w_scale, dtype, gran, block_size)


def decode_weight(
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: tuple[int, int],
) -> torch.Tensor:
    """Dequantized weight ``w_fp8 * w_scale`` in ``dtype`` (the C decode on CPU, else a
    compiled single pass)."""
    out = cpu_linear.decode_weight(w_fp8, w_scale, dtype, granularity, tuple(block_size))
    if out is not None:
        return out
    return compiled.run(
        _decode_weight,
        w_fp8,
        w_scale,
        dtype=dtype,
        gran=granularity,
        block_size=tuple(block_size),
        post=False,
    )


def _mm_forward(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    *,
    w_gran: str,
    block_size: tuple[int, int],
    act_dtype: torch.dtype | None,
    a_gran: str | None,
    w_post: bool,
    a_post: bool,
) -> torch.Tensor:
    dtype = x.dtype
    a, a_scale = x, None
    if act_dtype is not None:
        a, a_scale = _fake_quant_act(
            x,
            input_scale,
            act_dtype=act_dtype,
            gran=a_gran,
            bk=block_size[1],
            out_dtype=dtype,
            post=a_post,
        )
    w = _decode_weight(w_fp8, w_scale, dtype=dtype, gran=w_gran, block_size=block_size, post=w_post)
    if not (w_post or a_post):
        return F.linear(a, w, bias)
    return _epilogue(F.linear(a, w).float(), a_scale, w_scale if w_post else None, bias, dtype)


def _epilogue(
    acc: torch.Tensor,
    a_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp32 accumulator × (activation scale × weight scale) (``None``: folded into the
    operand) + bias, rounded once to ``out_dtype``. The scales multiply first: ``acc *
    a_scale`` alone can overflow fp32 where the output is finite (activations near 1e38)."""
    scale = None if w_scale is None else w_scale.float().reshape(1, -1)
    if a_scale is not None:
        scale = a_scale if scale is None else a_scale * scale
    if scale is not None:
        acc = acc * scale
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def _gemv(
    a: torch.Tensor,
    w_fp8: torch.Tensor,
    a_scale: torch.Tensor | None,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    tokens: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``tokens`` fp32 rows against an fp8 weight with a tensor / row scale.

    The rows are unrolled so that inductor fuses them into one pass over the weight:
    each fp8 element is loaded and decoded once, whatever the number of tokens.
    """
    w = w_fp8.float()
    acc = torch.stack([(a[i] * w).sum(-1) for i in range(tokens)])
    return _epilogue(acc, a_scale, w_scale, bias, out_dtype)


def emulated_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    weight_granularity: str,
    block_size: tuple[int, int],
    *,
    act_dtype: torch.dtype | None = None,
    act_granularity: str | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fake_quant(x) @ dequantize(w_fp8).T + bias`` in ``x.dtype`` (``x``: ``[..., K]``).

    ``act_dtype=None`` leaves activations in high precision (weight-only); otherwise they
    are quantized to ``act_dtype`` with ``act_granularity`` (numerics names: ``"tensor"``,
    ``"row"``, ``"block"`` of ``1 × block_size[1]``), or with ``input_scale`` (static).
    Never records autograd history: ``fp8_linear`` wraps it for gradients.
    """
    if x.dim() != 2:
        out = emulated_linear(
            x.reshape(-1, x.shape[-1]),
            w_fp8,
            w_scale,
            bias,
            weight_granularity,
            block_size,
            act_dtype=act_dtype,
            act_granularity=act_granularity,
            input_scale=input_scale,
        )
        return out.reshape(*x.shape[:-1], w_fp8.shape[0])
    if 0 in (x.shape[0], x.shape[1], w_fp8.shape[0]):
        # no tokens, no inputs (nn.Linear(0, n): zeros + bias) or no outputs (R24 F3): an
        # empty product, nothing to quantize
        return F.linear(x, x.new_zeros(w_fp8.shape[0], x.shape[1]), bias)
    block_size = (int(block_size[0]), int(block_size[1]))
    a_gran = act_granularity if act_dtype is not None else None
    if x.device.type == "cpu":  # the C kernels, where they build (hf_fp8.kernels.cpu_kernel)
        out = cpu_linear.linear(
            x, w_fp8, w_scale, bias, weight_granularity, block_size, act_dtype, a_gran, input_scale
        )
        if out is not None:
            return out
    if (
        x.shape[0] <= GEMV_MAX_TOKENS
        and x.device.type == "cpu"
        and weight_granularity in _PER_TENSOR_OR_ROW
    ):
        a, a_scale = x.float(), None
        if act_dtype is not None:  # quantized on its own: fused, it would be redone per row
            a, a_scale = compiled.run(
                _fake_quant_act,
                x,
                input_scale,
                act_dtype=act_dtype,
                gran=a_gran,
                bk=block_size[1],
                out_dtype=torch.float32,
                post=a_gran != _BLOCK,
            )
        out = compiled.run(
            _gemv, a, w_fp8, a_scale, w_scale, bias, tokens=x.shape[0], out_dtype=x.dtype
        )
        post = True  # the GEMV multiplies unscaled codes
    else:
        post = post_scaled(weight_granularity, x.dtype) or (
            act_dtype is not None and post_scaled(a_gran, x.dtype)
        )
        out = _mm(x, w_fp8, w_scale, bias, input_scale, weight_granularity, block_size,
                  act_dtype, a_gran, post)  # fmt: skip
    # unscaled codes (up to 448) times activations near FLT_MAX / 448 overflow where the
    # dequantized product is finite (R24 F2): then the call is redone with folded scales and
    # its rows of finite inputs are kept (CPU only: the check would synchronize a GPU)
    if not post or x.device.type != "cpu":
        return out

    def folded() -> torch.Tensor:
        return _mm(x, w_fp8, w_scale, bias, input_scale, weight_granularity, block_size,
                   act_dtype, a_gran, False)  # fmt: skip

    if torch.compiler.is_compiling():
        # traced: a data-dependent branch without a graph break (R28 B); the folded product
        # runs only where the predicate holds
        rows = _redo_rows(out, x)
        return torch.cond(
            rows.any(),
            lambda o, r: torch.where(r.unsqueeze(1), folded(), o),
            lambda o, r: o.clone(),
            (out, rows),
        )
    if not bool(cpu_kernel.finite_rows(out).all()):  # one fast pass (bf16 isfinite is slow)
        rows = _redo_rows(out, x)
        if bool(rows.any()):
            out = torch.where(rows.unsqueeze(1), folded(), out)
    return out


def _redo_rows(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The rows (bool ``[M]``) that take the folded product: a non-finite output row from a
    finite input row. A non-finite input row gives the same +-inf / NaN on the folded route
    (R28 C; a NaN / inf activation is a NaN code for every scheme, static included:
    ``saturated_cast``), and the other rows keep their post-scaled bits, those of a batch
    without the bad token (R38 F1)."""
    return ~out.isfinite().all(1) & x.isfinite().all(1)


def _mm(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    weight_granularity: str,
    block_size: tuple[int, int],
    act_dtype: torch.dtype | None,
    a_gran: str | None,
    post: bool,
) -> torch.Tensor:
    """``_mm_forward``, compiled; ``post=False`` folds every scale into the operands."""
    return compiled.run(
        _mm_forward,
        x,
        w_fp8,
        w_scale,
        bias,
        input_scale,
        w_gran=weight_granularity,
        block_size=block_size,
        act_dtype=act_dtype,
        a_gran=a_gran,
        w_post=post and post_scaled(weight_granularity, x.dtype),
        a_post=post and act_dtype is not None and post_scaled(a_gran, x.dtype),
    )
