"""Which FP8 gemm can run where."""

from __future__ import annotations

import torch

KERNELS = ("auto", "scaled_mm", "emulated")


def check_kernel(kernel: str) -> str:
    """Return ``kernel`` if it is one of ``KERNELS``, else raise ``ValueError``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not supported; use one of {KERNELS}")
    return kernel


def has_fp8_gemm(device: torch.device | str | None = None) -> bool:
    """True on CUDA devices with compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    if not torch.cuda.is_available():
        return False
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
