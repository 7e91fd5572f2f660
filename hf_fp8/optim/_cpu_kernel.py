"""Fused CPU kernel for the quantized AdamWFp8 step (C, compiled at first use).

Per group of ``group_size`` elements and in one pass over memory, the kernel dequantizes
both moments, updates the parameter (AdamW) and requantizes both moments (COAT or plain).
It mirrors :mod:`hf_fp8.numerics.coat` and :func:`hf_fp8.optim._step.grouped_step`
operation by operation (same fp32 operations in the same order, no FMA contraction,
correctly rounded ``sqrtf``), so its results are bit-identical to the reference; the tests
check this for every variant.

Each variant (parameter / gradient dtype fp32 or bf16, E4M3 or E5M2, expansion or not) is
built once (≈1 s) with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``,
``-O3 -march=native``) into ``$HF_FP8_CACHE`` (default ``~/.cache/hf_fp8``), keyed by a
hash of the source, flags, compiler and CPU, and loaded with :mod:`ctypes`. Threads: POSIX
threads, ``torch.get_num_threads()`` of them. Without a compiler :func:`load` returns
``None`` and the optimizer uses ``torch.compile`` of the reference, or the reference.
``HF_FP8_DISABLE_CPU_KERNEL=1`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from hf_fp8.numerics import coat
from hf_fp8.optim._csource import C_SOURCE_TEMPLATE

_CFLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
]
_LOCK = threading.Lock()
_LIBS: dict[int, ctypes.CDLL] = {}
_ERROR: str | None = None

# Flags of one task (bit field), matched in the C dispatcher.
P_BF16, G_BF16, E5M2, EXPAND = 1, 2, 4, 8
TASK_FIELDS = 13  # p, g, mq, ms, mk, vq, vs, vk, hp, rows, cols, group_size, flags


def _c_float(value: float) -> str:
    """A C expression that rounds ``value`` (a Python float) to float32 as torch does."""
    return f"((float){value!r})"


def _horner(var: str, coeffs: tuple[float, ...]) -> str:
    """C statements computing ``acc`` exactly as ``coat._horner`` does (before its last ``* var``)."""
    lines = [f"float acc = {var} * {_c_float(coeffs[-1])} + {_c_float(coeffs[-2])};"]
    lines += [f"acc = acc * {var} + {_c_float(c)};" for c in reversed(coeffs[:-2])]
    return "\n    ".join(lines)


def c_source() -> str:
    """The kernel's C source with coat's constants filled in."""
    consts = {
        "LOG2_HORNER": _horner("t", coat.LOG2_COEFFS),
        "EXP2_HORNER": _horner("f", coat.EXP2_COEFFS),
        "E4M3_MAX": _c_float(448.0),
        "E5M2_MAX": _c_float(57344.0),
        "E4M3_LOG2MAX": _c_float(math.log2(448.0)),
        "E5M2_LOG2MAX": _c_float(math.log2(57344.0)),
        "E4M3_STEPS": _c_float(coat.EXPONENT_STEPS * coat.target_log2_range(torch.float8_e4m3fn)),
        "E5M2_STEPS": _c_float(coat.EXPONENT_STEPS * coat.target_log2_range(torch.float8_e5m2)),
        "INV_STEPS": _c_float(1.0 / coat.EXPONENT_STEPS),
        "K_MIN": _c_float(coat.EXPONENT_MIN),
        "K_MAX": _c_float(coat.EXPONENT_MAX),
    }
    src = C_SOURCE_TEMPLATE
    for key, value in consts.items():
        src = src.replace("@" + key + "@", value)
    return src


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    """``$HF_FP8_CACHE``, else ``~/.cache/hf_fp8``, else a per-user temporary directory."""
    candidates = [os.environ.get("HF_FP8_CACHE"), Path.home() / ".cache" / "hf_fp8"]
    candidates.append(
        Path(tempfile.gettempdir()) / f"hf_fp8-{os.getuid() if hasattr(os, 'getuid') else 0}"
    )
    for candidate in candidates:
        if not candidate:
            continue
        try:
            path = Path(candidate)
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise RuntimeError("no writable cache directory for the CPU kernel (set $HF_FP8_CACHE)")


def _build(variant: int) -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC)")
    src = c_source()
    flags = [*_CFLAGS, f"-DVARIANT={variant}"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join([src, " ".join(flags), version, platform.machine(), _cpu_signature()]).encode()
    ).hexdigest()[:20]
    cache = _cache_dir()
    lib_path = cache / f"adamw_fp8_{variant}_{key}.so"
    if not lib_path.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            c_path = Path(tmp) / "kernel.c"
            c_path.write_text(src)
            out = Path(tmp) / "kernel.so"
            proc = subprocess.run(
                [cc, *flags, str(c_path), "-o", str(out), "-pthread"],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"compiling the CPU kernel failed:\n{proc.stderr[-2000:]}")
            os.replace(out, lib_path)  # atomic: concurrent ranks may build the same file
    lib = ctypes.CDLL(str(lib_path))
    lib.adamw_fp8_step.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.adamw_fp8_step.restype = ctypes.c_int
    return lib


def variant(
    param_dtype: torch.dtype, grad_dtype: torch.dtype, fp8: torch.dtype, expand: bool
) -> int:
    """Kernel variant (bit field) for these dtypes and mode."""
    return (
        (P_BF16 if param_dtype == torch.bfloat16 else 0)
        | (G_BF16 if grad_dtype == torch.bfloat16 else 0)
        | (E5M2 if fp8 == torch.float8_e5m2 else 0)
        | (EXPAND if expand else 0)
    )


def load(variant: int = EXPAND) -> ctypes.CDLL | None:
    """The compiled library of ``variant``, or ``None`` when it cannot be built (see :func:`error`)."""
    global _ERROR
    with _LOCK:
        if variant not in _LIBS and _ERROR is None:
            if os.environ.get("HF_FP8_DISABLE_CPU_KERNEL", "") not in ("", "0"):
                _ERROR = "disabled by HF_FP8_DISABLE_CPU_KERNEL"
            else:
                try:
                    _LIBS[variant] = _build(variant)
                except Exception as exc:  # any failure: fall back to torch.compile / reference
                    _ERROR = f"{type(exc).__name__}: {exc}"
        return _LIBS.get(variant)


def error() -> str | None:
    """Why :func:`load` returned ``None``."""
    return _ERROR


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def supports(param: torch.Tensor, grad: torch.Tensor, states: tuple) -> bool:
    """Whether the kernel handles this (local) parameter, gradient and state tensors."""
    return (
        param.device.type == "cpu"
        and grad.device.type == "cpu"
        and param.dtype in SUPPORTED_DTYPES
        and grad.dtype in SUPPORTED_DTYPES
        and param.is_contiguous()
        and all(s.is_contiguous() and s.device.type == "cpu" for s in states if s is not None)
    )


class Batch:
    """Quantized steps queued for one kernel launch per variant (see :meth:`run`)."""

    def __init__(self) -> None:
        self.tasks: list[list[int]] = []
        self.keep_alive: list[torch.Tensor] = []
        self.copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: tuple[torch.Tensor | None, ...],
        hp: torch.Tensor,
        cols: int,
        group_size: int,
        expand: bool,
        copy_to: torch.Tensor | None = None,
    ) -> None:
        """Queue the step of a contiguous ``param``; ``copy_to`` receives it after the run."""
        grad = grad.contiguous()
        m_q, m_s, m_e, v_q, v_s, v_e = states
        self.keep_alive += [param, grad, hp]
        self.tasks.append(
            [
                param.data_ptr(),
                grad.data_ptr(),
                m_q.data_ptr(),
                m_s.data_ptr(),
                0 if m_e is None else m_e.data_ptr(),
                v_q.data_ptr(),
                v_s.data_ptr(),
                0 if v_e is None else v_e.data_ptr(),
                hp.data_ptr(),
                param.shape[0],
                cols,
                group_size,
                variant(param.dtype, grad.dtype, m_q.dtype, expand),
            ]
        )
        if copy_to is not None and copy_to is not param:
            self.copy_back.append((copy_to, param))

    def run(self) -> None:
        if self.tasks:
            launch(self.tasks)
        for dst, src in self.copy_back:
            dst.copy_(src)


def launch(tasks: list[list[int]]) -> None:
    """Run the step on every task (``TASK_FIELDS`` int64 each), one library call per variant."""
    by_variant: dict[int, list[int]] = {}
    for task in tasks:
        by_variant.setdefault(task[-1], []).extend(task)
    for var, flat in by_variant.items():
        lib = load(var)
        if lib is None:
            raise RuntimeError(f"CPU kernel unavailable: {_ERROR}")
        arr = (ctypes.c_int64 * len(flat))(*flat)
        n = len(flat) // TASK_FIELDS
        rc = lib.adamw_fp8_step(n, ctypes.cast(arr, ctypes.c_void_p), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"CPU kernel failed with code {rc}")
