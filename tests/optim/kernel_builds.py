"""Routing the optimizer's kernel variants to libraries built another way (test helper)."""

from __future__ import annotations

import ctypes

import pytest

from hf_fp8.optim import _cpu_kernel
from hf_fp8.utils import native


def route_kernel_builds(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    *,
    defines: dict[str, object] | None = None,
    cflags: tuple[str, ...] = (),
) -> dict[int, ctypes.CDLL]:
    """Make ``_cpu_kernel.load`` build each variant as library ``name`` with extra
    ``defines`` / ``cflags``; returns the libraries built so far (by variant)."""
    built: dict[int, ctypes.CDLL] = {}

    def load(variant: int = _cpu_kernel.EXPAND) -> ctypes.CDLL:
        if variant not in built:
            lib = native.load_library(
                name,
                _cpu_kernel.SOURCE,
                defines={**_cpu_kernel.kernel_defines(variant), **(defines or {})},
                cflags=cflags,
            )
            lib.adamw_fp8_step.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            lib.adamw_fp8_step.restype = ctypes.c_int
            built[variant] = lib
        return built[variant]

    monkeypatch.setattr(_cpu_kernel, "load", load)
    return built
