"""Which FP8 gemm can run where."""

from __future__ import annotations

import torch

from hf_fp8.recipe import Kernel, parse, values

KERNELS = values(Kernel)


def check_kernel(kernel: str | Kernel) -> str:
    """``kernel`` as a plain word of :class:`~hf_fp8.recipe.Kernel`, else ``ValueError``
    naming the choices."""
    return parse(Kernel, kernel, "kernel").value


@torch.compiler.assume_constant_result
def _cuda_fp8_tensor_cores(index: int | None) -> bool:
    """CUDA device ``index`` (``None``: the current one) has compute capability >= 8.9.

    A constant to ``torch.compile``, evaluated once while tracing: dynamo does not
    constant-fold ``torch.cuda.get_device_capability`` and would trace it into the graph.
    """
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(index)) >= (8, 9)


def has_fp8_gemm(device: torch.device | str | None = None) -> bool:
    """True on CUDA devices with compute capability >= 8.9 (Ada, Hopper, Blackwell).

    Never on CPUs and never on ROCm: MI300 (gfx942) reports capability 9.4 but its
    ``torch._scaled_mm`` wants the ``*_fnuz`` fp8 dtypes, not ``float8_e4m3fn``.
    """
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        return False
    return _cuda_fp8_tensor_cores(device.index)
