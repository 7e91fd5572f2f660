"""FP8 linear on the CPU with the C kernels (:mod:`hf_fp8.kernels.cpu_kernel`).

Same numbers as the emulation (:mod:`hf_fp8.kernels.emulated`) up to fp32 reassociation:
the activation is fake-quantized by the emulation's own functions, run eagerly (no
inductor compile: the first call costs no more than the eager path, and new sequence
lengths never recompile), then

* up to ``gemv_limit()`` tokens (16 with bf16 dot products, 12 for bf16 on AVX2, else 4): the fused GEMV (fp32 activation, fp32 accumulation,
  the emulation's epilogue in C; block weight scales applied per K-block partial sum);
* above: the weight decoded tile by tile into the compute dtype (bf16 / fp32, bit-identical
  to the emulation's decode) and torch's matmul, then the emulation's epilogue (bf16 operands
  multiplied as fp32 and rounded to bf16 once where torch's bf16 matmul is slow:
  ``cpu_kernel.BF16_VIA_FP32``, AVX2 CPUs); with bf16
  on the ``avx512bf16`` path, the fused decode + GEMM instead (``cpu_kernel.fused_mm``),
  which also fake-quantizes dynamic (per token or per tensor) and static activations itself
  while packing them (same bits as ``quantize_activation``, one C call, no ``[M, K]``
  temporary).

:func:`linear` returns ``None`` where it does not apply (fp16 compute above the GEMV
limit, kernels off or unavailable); the caller runs the compiled emulation then.
"""

from __future__ import annotations

import torch

from hf_fp8.kernels import cpu_kernel
from hf_fp8.kernels import emulated as _emu  # circular: attributes used at call time

GEMV_MAX_TOKENS = cpu_kernel.GEMV_MAX_TOKENS
# With fp32 activations (paths without bf16 dot products, block-quantized activations, fp32
# compute) the GEMV's fp32 FMAs lose to decode + matmul from about 5 tokens on
# (benchmarks/bench_linear.py, AVX-512 path: 0.8x bf16 at 4 tokens, 3x at 16).
FP32_GEMV_MAX_TOKENS = 4
# On AVX2 the matmul it loses to is an fp32 one at a fifth of AVX-512's speed: the GEMV wins up
# to 12-16 tokens with bf16 compute (AMD EPYC Zen 1, 1 thread, 2048 -> 5632: 8 tokens 11.6 vs
# 15.3 ms, 12 tokens 17.3 vs 23.0 ms, 16 tokens 23.0 vs 21.2 ms); fp32 compute (not measured)
# keeps the general limit.
BF16_GEMV_MAX_TOKENS_BY_PATH = {"avx2": 12}


def gemv_limit(path: str, dtype: torch.dtype, act_block: bool) -> int:
    """Largest token count the fused GEMV takes for this path, compute dtype and recipe."""
    if dtype not in (torch.bfloat16, torch.float32):  # no decode + matmul path for fp16
        return GEMV_MAX_TOKENS
    bf16_dot = path in cpu_kernel.BF16_ACTIVATION_PATHS and dtype == torch.bfloat16
    if bf16_dot and not act_block:
        return GEMV_MAX_TOKENS
    by_path = BF16_GEMV_MAX_TOKENS_BY_PATH if dtype == torch.bfloat16 else {}
    return min(GEMV_MAX_TOKENS, by_path.get(path, FP32_GEMV_MAX_TOKENS))


_A_GRAN = {"tensor": "tensor", "row": "token", "block": None}


def linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    w_gran: str,
    block_size: tuple[int, int],
    act_dtype: torch.dtype | None,
    a_gran: str | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor | None:
    """``fake_quant(x) @ dequantize(w_fp8).T + bias`` for a 2-D CPU ``x``, or ``None``."""
    path = cpu_kernel.active_path()
    if path is None or w_fp8.dtype not in cpu_kernel.FORMATS:
        return None
    if functorch_active():  # torch.func transforms (R31 F7): the torch emulation
        return None
    m, dtype = x.shape[0], x.dtype
    bn, bk = block_size
    w_scale = w_scale.detach().float().reshape(-1).contiguous()
    w_fp8 = w_fp8.detach().contiguous()
    if m <= gemv_limit(path, dtype, a_gran == "block"):
        # exact bf16 operands (a bf16 input, or fp8 values) take the bf16 dot products there
        a_dtype = torch.float32
        if path in cpu_kernel.BF16_ACTIVATION_PATHS and dtype == torch.bfloat16:
            a_dtype = torch.bfloat16 if a_gran != "block" else torch.float32
        a, a_scale, a_kind = x.detach().to(a_dtype).contiguous(), None, None
        if act_dtype is not None:
            a, a_scale = _quantize_act(
                x, input_scale, act_dtype, a_gran, bk, a_dtype, a_gran != "block", path
            )
            a = a.contiguous()
            a_kind = _A_GRAN[a_gran]
            if a_scale is not None:
                a_scale = a_scale.float().reshape(-1).contiguous()
        b = None if bias is None else bias.detach().float().contiguous()
        gemv = cpu_kernel._gemv_impl if _eager(a, w_fp8) else cpu_kernel.cpu_gemv
        return gemv(a, w_fp8, w_scale, a_scale, b, w_gran, bn, bk, a_kind, dtype, path)
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    w_post = _emu.post_scaled(w_gran, dtype)
    if (
        act_dtype is not None
        and a_gran in ("row", "tensor")
        and (input_scale is None or (a_gran == "tensor" and input_scale.numel() == 1))
        and dtype == torch.bfloat16
        and x.shape[1] % 2 == 0
        and _eager(x, w_fp8)  # first: a compile traces the quantization + op instead
        and cpu_kernel.fused_mm_enabled(path)
    ):  # dynamic (per token / tensor) or static scales: quantized inside the fused kernel
        b = None if bias is None else bias.detach().contiguous()
        s = None if input_scale is None else input_scale.detach().float().reshape(1).contiguous()
        return cpu_kernel.fused_mm(
            x.detach().contiguous(), w_fp8, w_scale, s, b, w_gran, bn, bk, w_post, path,
            quantize=act_dtype, quantize_gran=a_gran,
        )  # fmt: skip
    a, a_scale, a_post = x.detach().contiguous(), None, False
    if act_dtype is not None:
        a_post = _emu.post_scaled(a_gran, dtype)
        a, a_scale = _quantize_act(x, input_scale, act_dtype, a_gran, bk, dtype, a_post, path)
        a = a.contiguous()
    b = None if bias is None else bias.detach().contiguous()
    if a_scale is not None:
        a_scale = a_scale.float().reshape(-1).contiguous()
    mm = cpu_kernel._fp8_mm_impl if _eager(a, w_fp8) else cpu_kernel.cpu_fp8_mm
    return mm(a, w_fp8, w_scale, a_scale if a_post else None, b, w_gran, bn, bk, w_post, path)


_peek_interpreter = getattr(torch._C._functorch, "peek_interpreter_stack", None)


def functorch_active() -> bool:
    """A ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...) is running here: its
    tensors (``vmap``'s batched ones) have no storage a C kernel could read, and neither a
    compile nor a host read may run under it. One C call (not one per tensor); inside an
    ``autograd.Function``'s forward under ``grad`` the tensors are plain and this is
    ``False``. ``False`` while dynamo traces (it cannot call this; the traced ops go
    through the custom ops)."""
    if torch.compiler.is_compiling():
        return False
    return _peek_interpreter is not None and _peek_interpreter() is not None


def _eager(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Plain tensors outside a compile: the kernels run without the custom-op dispatch
    (about 10 us a call); traced or fake tensors go through the op and its fake kernel."""
    return type(a) is torch.Tensor and type(w) is torch.Tensor and not torch.compiler.is_compiling()


def _quantize_act(
    x: torch.Tensor,
    input_scale: torch.Tensor | None,
    act_dtype: torch.dtype,
    gran: str,
    bk: int,
    out_dtype: torch.dtype,
    post: bool,
    path: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The emulation's activation fake-quantization: in C (bit-identical, one pass) where it
    applies, else the emulation's own torch code (eager, or traced by the user's compile)."""
    x = x.detach()
    if (
        torch.compiler.is_compiling()
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.shape[1] < 2
        or out_dtype not in (torch.float32, torch.bfloat16)
    ):
        return _emu._fake_quant_act(
            x, input_scale, act_dtype=act_dtype, gran=gran, bk=bk, out_dtype=out_dtype, post=post
        )
    return cpu_kernel.quantize_activation(
        x.contiguous(), input_scale, act_dtype, gran, bk, out_dtype, post, path
    )


def decode_weight(
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: tuple[int, int],
) -> torch.Tensor | None:
    """``dequantize(w_fp8, w_scale, dtype, ...)`` with the C decode, or ``None``."""
    if (
        torch.compiler.is_compiling()
        or w_fp8.device.type != "cpu"
        or dtype not in (torch.bfloat16, torch.float32)
        or w_fp8.dtype not in cpu_kernel.FORMATS
    ):
        return None
    path = cpu_kernel.active_path()
    if path is None or functorch_active():
        return None
    scale = w_scale.detach().float().reshape(-1).contiguous()
    return cpu_kernel.decode(
        w_fp8.detach().contiguous(), scale, granularity, block_size, dtype, path=path
    )
