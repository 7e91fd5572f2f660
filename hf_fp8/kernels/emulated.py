"""Fast FP8 emulation: dequantize, then a matmul in the compute dtype.

This is the path for CPUs and GPUs without FP8 tensor cores. It never calls the CPU
``torch._scaled_mm`` (tensor-wise scales go through oneDNN there and are thousands of
times slower than a bf16 matmul). Numerics match ``_scaled_mm`` on the same quantized
operands up to the rounding of the compute dtype.

The fp8 → compute-dtype decode is a single pass compiled with inductor (eager
``Tensor.to`` from fp8 is scalar on many CPUs); for one or two tokens a fused
decode-and-reduce (GEMV) reads the fp8 weight once and never materialises it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from hf_fp8.kernels.capability import compile_enabled
from hf_fp8.numerics import dequantize

# At or below this many tokens a fused decode + reduction beats decode + matmul on CPU.
GEMV_MAX_TOKENS = 2


def _decode_weight(w_fp8, w_scale, dtype: torch.dtype, granularity: str, block_size):
    return dequantize(w_fp8, w_scale, dtype, granularity, block_size)


def _gemv(x2d: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x2d [M<=2, K] against fp8 [N, K] with a tensor or row scale; fp32 accumulation."""
    acc = (x2d.float()[:, None, :] * w_fp8.float()[None]).sum(-1)
    return (acc * w_scale.reshape(1, -1)).to(x2d.dtype)


_FAILED: set[str] = set()


def _maybe_compiled(fn: Callable) -> Callable:
    """Run ``fn`` compiled by inductor (dynamic shapes); fall back to eager once on failure."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if (
            not compile_enabled()
            or fn.__name__ in _FAILED
            or torch.compiler.is_compiling()  # the user's torch.compile traces the eager body
        ):
            return fn(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as err:  # compiler missing or broken: stay correct, lose speed
            _FAILED.add(fn.__name__)
            warnings.warn(
                f"hf_fp8: compiling {fn.__name__} failed ({type(err).__name__}: {err}); "
                "using the eager FP8 emulation (slower). Set HF_FP8_COMPILE=0 to silence.",
                stacklevel=2,
            )
            return fn(*args, **kwargs)

    return run


decode_weight = _maybe_compiled(_decode_weight)
gemv = _maybe_compiled(_gemv)


def emulated_linear(
    x_hp: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    weight_granularity: str,
    block_size: tuple[int, int],
) -> torch.Tensor:
    """``x_hp @ dequantize(w_fp8).T + bias`` in ``x_hp.dtype``.

    ``x_hp`` is already (fake-)quantized by the caller when activations are FP8.
    """
    tokens = x_hp.numel() // max(x_hp.shape[-1], 1)
    use_gemv = (
        tokens <= GEMV_MAX_TOKENS
        and weight_granularity != "block"
        and not (x_hp.requires_grad and torch.is_grad_enabled())
    )
    if use_gemv:
        out = gemv(x_hp.reshape(-1, x_hp.shape[-1]), w_fp8, w_scale)
        out = out.reshape(*x_hp.shape[:-1], w_fp8.shape[0])
        return out if bias is None else out + bias
    w_hp = decode_weight(w_fp8, w_scale, x_hp.dtype, weight_granularity, block_size)
    return torch.nn.functional.linear(x_hp, w_hp, bias)
