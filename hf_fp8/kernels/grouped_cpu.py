"""Grouped FP8 projection of MoE experts on the CPU, with the C kernels (``cpu_kernel``).

The per-expert route of :func:`hf_fp8.kernels.grouped.grouped_fp8_linear` runs one
``fp8_linear`` per expert present. On the CPU, for an expert that received more rows than
the fused GEMV takes (``cpu_linear.gemv_limit``), that call decodes the weight tile by tile,
multiplies each tile, joins the tiles with a ``cat`` and runs the epilogue, and the grouped
route joins the experts with another ``cat``. :func:`grouped_linear` does the same math with
less around it:

* token-local activation scales (dynamic per token, or 1 × bk blocks) are computed for all
  rows in one pass, and, given the token rows (``tokens``), once per *token* rather than
  once per (token, expert) pair, then gathered: a row's scale never depends on its expert,
  so the numbers are those of quantizing each pair. Per-tensor dynamic scales (one per
  expert's group of rows) and static scales (one per expert) are computed per expert, as
  ``fp8_linear`` computes them;
* each expert's rows are multiplied into its rows of one preallocated output: with bf16
  compute where ``cpu_kernel.fused_mm_enabled`` (AVX-512 BF16 without AMX), by the C decode +
  GEMM + epilogue (``cpu_kernel.fused_mm``, the kernel ``fp8_linear`` runs there, with the
  activation already quantized, writing into those rows); elsewhere the expert's weight is decoded once, whole, into
  one reused buffer (``cpu_kernel.decode``, unscaled where the emulation applies the scale
  after the matmul), multiplied by ``torch.mm`` (``F.linear(w, a)``, the tiled path's form,
  is 10-40 % slower at 48-96 rows except at multiples of 16), then the emulation's epilogue
  (``emulated._epilogue``: scales, bias, one rounding);
* experts with at most ``gemv_limit`` rows take ``fp8_linear`` (the fused GEMV) as before.

Numbers: the emulation's (``emulated._mm_forward``); bit for bit with the decode +
``torch.mm`` route, up to the fp32 summation order inside the fused C GEMM. ``None`` is returned where this path does not apply (not CPU, C kernels off or
unavailable, fp16 compute, under ``torch.compile``, ``kernel="scaled_mm"``): the caller runs
the per-expert route then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_fp8.kernels import cpu_kernel, cpu_linear
from hf_fp8.kernels import emulated as _emu
from hf_fp8.kernels.fp8_linear import LinearPlan, fp8_linear
from hf_fp8.recipe import Granularity, Kernel

if TYPE_CHECKING:
    from hf_fp8.kernels.grouped import Routing

_TOKEN_LOCAL = (Granularity.ROW.value, Granularity.BLOCK.value)  # a row's scale is its own
_SCALED_MM = Kernel.SCALED_MM.value


def cpu_path(x: torch.Tensor, w_fp8: torch.Tensor, plan: LinearPlan) -> str | None:
    """The C kernel path :func:`grouped_linear` would use for ``x`` and ``w_fp8``, or ``None``."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    if plan.kernel == _SCALED_MM and plan.act_dtype is not None:
        return None  # fp8_linear says why torch._scaled_mm cannot run here
    if x.dtype not in (torch.bfloat16, torch.float32) or w_fp8.dtype not in cpu_kernel.FORMATS:
        return None
    return cpu_kernel.active_path()


def _quantize(
    x: torch.Tensor, plan: LinearPlan, input_scale: torch.Tensor | None, post: bool, path: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The emulation's activation operand of ``x`` (``cpu_linear._quantize_act``)."""
    return cpu_linear._quantize_act(
        x, input_scale, plan.act_dtype, plan.act_granularity, plan.block_size[1], x.dtype, post,
        path,
    )  # fmt: skip


def grouped_linear(
    x_sorted: torch.Tensor | None,
    routing: Routing,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    plan: LinearPlan,
    input_scale: torch.Tensor | None,
    path: str,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[S, N]``: each expert's rows of ``x_sorted`` through its FP8 weight (see the module
    docstring). ``tokens`` ``[T, K]``: the rows ``x_sorted`` is gathered from
    (``tokens[routing.token_index]``); with it ``x_sorted`` may be ``None``. ``path``: from
    :func:`cpu_path`. No autograd (the caller routes gradients elsewhere)."""
    rows_of = routing.token_index
    source = x_sorted if x_sorted is not None else tokens
    assert source is not None
    dtype = source.dtype
    _, n, k = w_fp8.shape
    s = len(routing.expert_ids)
    w_gran = plan.weight_granularity
    a_gran = plan.act_granularity  # "tensor" for static scales; None: weight-only
    w_post = _emu.post_scaled(w_gran, dtype)
    a_post = a_gran is not None and _emu.post_scaled(a_gran, dtype)
    limit = cpu_linear.gemv_limit(path, dtype, a_gran == Granularity.BLOCK.value)
    present = routing.present()
    out = torch.empty(s, n, dtype=dtype)

    def rows(values: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """An expert's rows of ``values`` (sorted rows, or per-token rows gathered here: one
        expert's worth at a time, while it is in cache)."""
        return values[start:end] if x_sorted is not None else values[rows_of[start:end]]

    # token-local activation scales: one pass over every row, or over the tokens
    a_src = a_scale_src = None
    token_local = a_gran in _TOKEN_LOCAL and not plan.static
    if token_local and any(end - start > limit for _, start, end in present):
        a_src, a_scale_src = _quantize(source.contiguous(), plan, None, a_post, path)

    scales = w_scale.detach().float()
    fused = dtype == torch.bfloat16 and k % 2 == 0 and cpu_kernel.fused_mm_enabled(path)
    via_fp32 = not fused and dtype == torch.bfloat16 and cpu_kernel.bf16_matmul_via_fp32()
    # the decoded weight: None for the fused C GEMM; one tile where the products run as fp32
    # matmuls tile by tile (_multiply_via_fp32); else the whole expert
    buffer = None if fused else torch.empty((_tile_rows(n, k) if via_fp32 else n) * k, dtype=dtype)
    for expert, start, end in present:
        b = None if bias is None else bias[expert].detach().to(dtype)
        e_scale = None if input_scale is None else input_scale[expert : expert + 1]
        if end - start <= limit:  # the fused GEMV
            out[start:end] = fp8_linear(
                rows(source, start, end), w_fp8[expert], w_scale[expert], b, plan=plan,
                input_scale=e_scale,
            )  # fmt: skip
            continue
        if plan.act_dtype is None:
            a, a_scale = rows(source, start, end), None
        elif a_src is not None:
            a = rows(a_src, start, end)
            a_scale = None if a_scale_src is None else rows(a_scale_src, start, end)
        else:  # one scale for the expert's rows: its group amax, or its static scale
            a, a_scale = _quantize(
                rows(source, start, end).contiguous(), plan, e_scale, a_post, path
            )
        w_e = scales[expert].reshape(-1).contiguous()
        codes = w_fp8[expert].detach().contiguous()
        _multiply(a, a_scale, codes, w_e, b, out[start:end], plan, a_post, w_post, buffer, path)
    return out


def _multiply(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    codes: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: LinearPlan,
    a_post: bool,
    w_post: bool,
    buffer: torch.Tensor | None,
    path: str,
) -> None:
    """``out`` (rows of the grouped output) = one expert's product, as ``_mm_forward``:
    activation operand ``a`` (scale ``a_scale`` applied after the matmul when ``a_post``),
    fp8 ``codes`` with fp32 ``w_scale`` (flat), ``bias`` in the compute dtype. ``buffer``:
    room for the decoded weight, ``None`` for the fused C decode + GEMM."""
    bn, bk = plan.block_size
    if out.dtype == torch.bfloat16 and buffer is not None and cpu_kernel.bf16_matmul_via_fp32():
        _multiply_via_fp32(
            a, a_scale, codes, w_scale, bias, out, plan, a_post, w_post, buffer, path
        )
        _redo_if_overflow(a, a_scale, codes, w_scale, bias, out, plan, a_post, w_post, buffer,
                          path)  # fmt: skip
        return
    if buffer is None:  # the C decode + GEMM + epilogue, straight into ``out``
        if a_scale is not None:
            a_scale = a_scale.reshape(-1).contiguous()
        cpu_kernel.fused_mm(
            a.contiguous(), codes, w_scale, a_scale if a_post else None, bias,
            plan.weight_granularity, bn, bk, w_post, path, out=out,
        )  # fmt: skip
        return
    w = cpu_kernel.decode(
        codes, None if w_post else w_scale, plan.weight_granularity, (bn, bk), out.dtype,
        out=buffer, path=path,
    )  # fmt: skip
    if not (w_post or a_post):  # scales folded into the operands
        if bias is None:
            torch.mm(a, w.t(), out=out)
        else:
            out.copy_(F.linear(a, w, bias))
        return
    acc = torch.mm(a, w.t())  # bf16 x fp32 scale promotes to fp32: no .float() pass
    out.copy_(
        _emu._epilogue(acc, a_scale if a_post else None, w_scale if w_post else None, bias,
                       out.dtype)
    )  # fmt: skip
    _redo_if_overflow(a, a_scale, codes, w_scale, bias, out, plan, a_post, w_post, buffer,
                      path)  # fmt: skip


def _redo_if_overflow(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    codes: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: LinearPlan,
    a_post: bool,
    w_post: bool,
    buffer: torch.Tensor,
    path: str,
) -> None:
    """After a post-scaled product (unscaled codes, up to 448, times the activation):
    activations near ``FLT_MAX / 448`` overflow its fp32 sums where the dequantized product
    is finite (R28 A, as R24 F2 for the dense routes). Where some output is not finite and
    its activation row is (``cpu_kernel.redo_rows``), the expert is multiplied again with
    every scale folded into the bf16 operands (the emulation's folded route), and those rows
    only are taken from it: the expert's other tokens keep their bits (R38 F1)."""
    if not (w_post or a_post) or bool(cpu_kernel.finite_rows(out).all()):
        return
    rows = cpu_kernel.redo_rows(out, a, a_scale if a_post else None)
    if not bool(rows.any()):
        return  # the non-finite outputs come from non-finite inputs: the redo gives them too
    a_f = cpu_kernel._fold_activation(a, a_scale if a_post else None)
    redo = torch.empty_like(out)
    _multiply(a_f, None, codes, w_scale, bias, redo, plan, False, False, buffer, path)
    out[rows] = redo[rows]


def _tile_rows(n: int, k: int) -> int:
    """Weight rows per fp32 tile: ``cpu_kernel.TILE_BYTES`` of fp32 (``_fp8_mm_impl``'s)."""
    return max(16, min(n, cpu_kernel.TILE_BYTES // (k * 4) // 16 * 16))


def _multiply_via_fp32(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    codes: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: LinearPlan,
    a_post: bool,
    w_post: bool,
    buffer: torch.Tensor,
    path: str,
) -> None:
    """``_multiply`` with bf16 operands multiplied in fp32 (exact) where the bf16 matmul is
    slow (``cpu_kernel.BF16_VIA_FP32``, AVX2 CPUs): the same products and fp32 sums, rounded
    to bf16 once per output as the bf16 matmul rounds them. Tile by tile (``_tile_rows``
    weight rows): the weight tile decoded (unscaled codes straight to fp32, exact; folded
    scales to bf16 in ``buffer``, then exactly to fp32), multiplied, and its products rounded
    into ``out``'s columns at once (elementwise: the same bits as rounding the whole product;
    splitting the output columns leaves each output's fp32 sum as it was). A whole-expert
    fp32 copy (R24 F4: +220 MiB peak for one 8192 x 4096 expert) is never made."""
    bn, bk = plan.block_size
    n, k = codes.shape
    rows = _tile_rows(n, k)
    a32 = a.float()
    b32 = None if bias is None else bias.float()
    post = w_post or a_post
    tile32 = torch.empty(rows * k, dtype=torch.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        if w_post:
            w = cpu_kernel.decode(
                codes, None, plan.weight_granularity, (bn, bk), torch.float32, rows=(r0, r1),
                out=tile32, path=path,
            )  # fmt: skip
        else:
            w = cpu_kernel.decode(
                codes, w_scale, plan.weight_granularity, (bn, bk), torch.bfloat16, rows=(r0, r1),
                out=buffer, path=path,
            )  # fmt: skip
            w = tile32[: w.numel()].view(w.shape).copy_(w)
        if post:  # the bf16 product (the epilogue below scales it)
            out[:, r0:r1] = torch.mm(a32, w.t())
        else:  # folded scales: the bias joins the fp32 sum, one rounding
            out[:, r0:r1] = F.linear(a32, w, None if b32 is None else b32[r0:r1])
    if post:
        out.copy_(
            _emu._epilogue(out, a_scale if a_post else None, w_scale if w_post else None, bias,
                           out.dtype)
        )  # fmt: skip
