"""Fused CPU kernel for the quantized AdamWFp8 step (C, compiled at first use).

Per group of ``group_size`` elements and in one pass over memory, the kernel dequantizes
both moments, updates the parameter (AdamW) and requantizes both moments (COAT or plain).
It mirrors :mod:`hf_fp8.numerics.coat` and :func:`hf_fp8.optim._step.grouped_step`
operation by operation (same fp32 operations in the same order, no FMA contraction,
correctly rounded ``sqrtf``), so its results are bit-identical to the reference; the tests
check this for every variant.

The source is ``csrc/adamw_fp8.c``. Everything it shares with Python — the task layout
(:data:`TASK_FIELDS`), the hyper-parameter slots (:data:`hf_fp8.optim._step.HP_FIELDS`), the
variant flag bits (:data:`FLAGS`) and coat's constants — is passed from here as ``-D``
defines (:func:`kernel_defines`); the C file restates none of them.

Each variant (parameter / gradient dtype fp32 or bf16; ``moment_format="log"``
(:mod:`hf_fp8.numerics.log_moments`: int32 / fp32 bit arithmetic only, no log2 / exp2) or the
fp8 codes (E4M3 or E5M2, COAT expansion or not); stochastic rounding per moment) is one
library, built once by :func:`hf_fp8.utils.native.load_library` (private ``0700`` cache,
build lock, per-variant failure record; ``HF_FP8_DISABLE_CPU_KERNEL=1`` turns it off).
Threads: ``torch.get_num_threads()`` of them, torch's own OpenMP pool where it is GCC's libgomp
(:func:`shares_torch_openmp`), else POSIX threads; they take the groups from a shared counter. When a variant is unavailable
:func:`load` returns ``None`` and :func:`error` says why.

Sizes are never trusted: :meth:`Batch.add` checks every tensor's dtype, shape, device and
contiguity against the parameter right before queuing it, and each task carries the element
count of every tensor, which the C side checks against rows, cols and group_size before it
touches any memory.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from hf_fp8.numerics import coat
from hf_fp8.numerics import log_moments as lm
from hf_fp8.optim import _step
from hf_fp8.utils import native

SOURCE = Path(__file__).with_name("csrc") / "adamw_fp8.c"

# Variant flag bits (one library per combination).
FLAGS = {
    "P_BF16": 1,
    "G_BF16": 2,
    "E5M2": 4,
    "EXPAND": 8,
    "SR_M": 16,
    "SR_V": 32,
    "SQRT_V": 64,
    "LOG": 128,  # moment_format="log" (hf_fp8.numerics.log_moments)
}
P_BF16, G_BF16, E5M2, EXPAND = (FLAGS[k] for k in ("P_BF16", "G_BF16", "E5M2", "EXPAND"))
SR_M, SR_V, SQRT_V, LOG = FLAGS["SR_M"], FLAGS["SR_V"], FLAGS["SQRT_V"], FLAGS["LOG"]
# One task = these int64 fields, in this order: pointers, the [rows, cols] view, the group
# size, the variant flags, the stochastic-rounding stream keys of the two moments (uint32,
# already offset by the shard's first element), then the element count of every tensor.
TASK_FIELDS = (
    "p",
    "g",
    "m_q",
    "m_s",
    "m_k",
    "v_q",
    "v_s",
    "v_k",
    "hp",
    "rows",
    "cols",
    "group_size",
    "flags",
    "key_m",
    "key_v",
    "p_n",
    "g_n",
    "m_q_n",
    "m_s_n",
    "m_k_n",
    "v_q_n",
    "v_s_n",
    "v_k_n",
    "hp_n",
)
# Return codes of adamw_fp8_step.
ERRORS = {
    1: "out of memory",
    2: "a task of another variant",
    3: "tensor sizes that do not match the parameter",
    4: "a null pointer",
}

_LOCK = threading.Lock()
_LIBS: dict[int, ctypes.CDLL] = {}
_ERRORS: dict[int, str] = {}


def kernel_defines(variant: int) -> dict[str, object]:
    """The ``-D`` defines of ``variant``: layout, flag bits and coat's constants."""
    d: dict[str, object] = {"VARIANT": variant, "T_FIELDS": len(TASK_FIELDS)}
    d.update({f"T_{name.upper()}": i for i, name in enumerate(TASK_FIELDS)})
    d["HP_FIELDS"] = len(_step.HP_FIELDS)
    d.update({f"HP_{name.upper()}": i for i, name in enumerate(_step.HP_FIELDS)})
    d.update({f"FLAG_{name}": bit for name, bit in FLAGS.items()})
    d["LOG2_NCOEFFS"] = len(coat.LOG2_COEFFS)
    d.update({f"LOG2_C{i}": float(c) for i, c in enumerate(coat.LOG2_COEFFS)})
    d["EXP2_NCOEFFS"] = len(coat.EXP2_COEFFS)
    d.update({f"EXP2_C{i}": float(c) for i, c in enumerate(coat.EXP2_COEFFS)})
    for name, dtype in (("E4M3", torch.float8_e4m3fn), ("E5M2", torch.float8_e5m2)):
        fmax = float(torch.finfo(dtype).max)
        d[f"{name}_MAX"] = fmax
        d[f"{name}_LOG2MAX"] = math.log2(fmax)
        d[f"{name}_STEPS"] = coat.EXPONENT_STEPS * coat.target_log2_range(dtype)
        d[f"{name}_SR_DROP"] = coat.SR_DROP_BITS[dtype]
        d[f"{name}_SR_UNIT"] = 2.0 ** -coat.SR_DROP_BITS[dtype]
        d[f"{name}_SR_STEPS"] = coat.SR_SUBNORMAL_STEPS[dtype]
        d[f"{name}_SR_INV_STEPS"] = 1.0 / coat.SR_SUBNORMAL_STEPS[dtype]
        d[f"{name}_SR_MIN_NORMAL"] = coat.SR_MIN_NORMAL[dtype]
        d[f"{name}_MIN_SUB"] = coat.MIN_SUBNORMAL[dtype]
    d["SR_WEYL"] = f"{coat.SR_WEYL:#x}u"
    d["INV_STEPS"] = 1.0 / coat.EXPONENT_STEPS
    d["K_MIN"] = float(coat.EXPONENT_MIN)
    d["K_MAX"] = float(coat.EXPONENT_MAX)
    d["DEC_Y_MAX"] = coat.DECODE_Y_MAX
    d["LOG_V_MAX"] = lm.V_CODE_MAX
    d["LOG_M_MAX"] = lm.M_CODE_MAX
    d["LOG_V_RANGE_STEPS"] = float(lm.V_RANGE_STEPS)
    d["LOG_V_ENC"] = lm.V_ENC
    d["LOG_V_DEC"] = lm.V_DEC
    d["LOG_M_MIN"] = lm.M_MIN
    d["LOG_M_SAT"] = lm.M_MAX
    d["LOG_INV_2_23"] = 2.0**-23
    d["LOG_SR_SHIFT"] = lm.SR_SHIFT
    d["LOG_SR_UNIT"] = 2.0**-24
    d["LOG_INV_2_24"] = 2.0**-24
    d["LOG_WEYL"] = f"{lm.WEYL:#x}u"
    d["LOG_E_MAX"] = lm.E_MAX
    d["LOG_E_SLOPE"] = 2.0**-5
    return d


def variant(
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    fp8: torch.dtype,
    expand: bool,
    *,
    sqrt_v: bool = False,
    sr_m: bool = False,
    sr_v: bool = False,
    log: bool = False,
) -> int:
    """Kernel variant (bit field of :data:`FLAGS`) for these dtypes and options."""
    if log:  # the codes are int8 / uint8: no fp8 format, no COAT flag
        return (
            (P_BF16 if param_dtype == torch.bfloat16 else 0)
            | (G_BF16 if grad_dtype == torch.bfloat16 else 0)
            | LOG
            | (SR_M if sr_m else 0)
            | (SR_V if sr_v else 0)
        )
    return (
        (P_BF16 if param_dtype == torch.bfloat16 else 0)
        | (G_BF16 if grad_dtype == torch.bfloat16 else 0)
        | (E5M2 if fp8 == torch.float8_e5m2 else 0)
        | (EXPAND if expand else 0)
        | (SQRT_V if sqrt_v else 0)
        | (SR_M if sr_m else 0)
        | (SR_V if sr_v else 0)
    )


OPENMP_ENV = "HF_FP8_OPTIM_OPENMP"  # "0": POSIX threads even where torch's libgomp is loaded


def shares_torch_openmp() -> bool:
    """Whether the kernel's threads can be torch's own OpenMP pool: Linux, torch's parallel
    backend is OpenMP with a ``libgomp`` already loaded in this process, and the C compiler is
    GCC (its ``-fopenmp`` links ``libgomp.so.1``, which the loader resolves to that copy).
    ``HF_FP8_OPTIM_OPENMP=0`` turns it off.

    With POSIX threads instead, torch's pool threads, which spin-wait for a few ms after each
    of torch's parallel regions (the backward pass, a fused AdamW), compete with the kernel's
    threads for the cores: measured 16.5 ms instead of 12.9 ms for a 2-thread step."""
    if os.environ.get(OPENMP_ENV, "") == "0":
        return False
    if os.environ.get(native.DISABLE_ENV, "") not in ("", "0"):
        return False  # no build at all: one attempt, one recorded reason
    return _torch_libgomp_and_gcc()


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped in this process (Linux ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return set()
    return {p for p in paths if any(n in Path(p).name for n in ("gomp", "libomp", "iomp"))}


@functools.lru_cache(maxsize=1)
def _torch_libgomp_and_gcc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    # the one runtime is GCC's, under its own soname (a wheel's renamed copy such as
    # libgomp-<hash>.so.1 would not satisfy the kernel's libgomp.so.1: a second runtime)
    if [Path(p).name for p in _openmp_runtimes()] != ["libgomp.so.1"]:
        return False
    cc = native.compiler()
    if cc is None:
        return False
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in proc.stdout and "clang" not in proc.stdout


def load(variant: int = EXPAND) -> ctypes.CDLL | None:
    """The compiled library of ``variant``, or ``None`` when it cannot be built (see :func:`error`).

    Threads: torch's OpenMP pool where :func:`shares_torch_openmp`, else POSIX threads (also
    when the OpenMP build fails)."""
    with _LOCK:
        if variant in _LIBS:
            return _LIBS[variant]
        if variant in _ERRORS:  # recorded for this variant: no retry on every step
            return None
        lib = None
        if shares_torch_openmp():
            before = _openmp_runtimes()
            try:
                lib = native.load_library(
                    "adamw_fp8",
                    SOURCE,
                    defines={**kernel_defines(variant), "USE_OMP": 1},
                    cflags=("-fopenmp",),
                )
            except native.NativeUnavailable:
                lib = None  # POSIX threads below
            if lib is not None and _openmp_runtimes() != before:
                lib = None  # it brought a runtime of its own: never call it, POSIX threads
        try:
            if lib is None:
                lib = native.load_library("adamw_fp8", SOURCE, defines=kernel_defines(variant))
        except native.NativeUnavailable as exc:
            _ERRORS[variant] = str(exc)
            return None
        lib.adamw_fp8_step.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        lib.adamw_fp8_step.restype = ctypes.c_int
        _LIBS[variant] = lib
        return lib


def error(variant: int = EXPAND) -> str | None:
    """Why :func:`load` returned ``None`` for ``variant``."""
    return _ERRORS.get(variant)


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


def check_tensors(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: tuple[torch.Tensor | None, ...],
    hp: torch.Tensor,
    cols: int,
    group_size: int,
    expand: bool,
    log: bool = False,
) -> None:
    """Raise ``ValueError`` unless every tensor is exactly what the kernel will address.

    ``log``: ``moment_format="log"`` (int8 ``exp_avg`` codes without exponent, uint8
    ``exp_avg_sq`` codes with one).

    Cheap (metadata only); run right before each launch so that no state, however it was
    loaded or modified, reaches the C code with a size that does not match the parameter.
    """
    rows = param.shape[0] if param.dim() else 1
    gc = -(-cols // group_size) if group_size > 0 else 0
    want = {
        "exp_avg_fp8": ((rows, gc * group_size), None),
        "exp_avg_scale": ((rows, gc), torch.float32),
        "exp_avg_exponent": ((rows, gc), torch.float32),
        "exp_avg_sq_fp8": ((rows, gc * group_size), None),
        "exp_avg_sq_scale": ((rows, gc), torch.float32),
        "exp_avg_sq_exponent": ((rows, gc), torch.float32),
    }
    problems = []
    if param.device.type != "cpu" or not param.is_contiguous():
        problems.append("the parameter is not a contiguous CPU tensor")
    if param.dtype not in SUPPORTED_DTYPES or param.numel() != rows * cols:
        problems.append(f"the parameter ({param.dtype}, {tuple(param.shape)}) is not {rows}x{cols}")
    if grad.shape != param.shape or grad.dtype not in SUPPORTED_DTYPES or not grad.is_contiguous():
        problems.append(f"the gradient {tuple(grad.shape)} {grad.dtype} does not match")
    if grad.device.type != "cpu":
        problems.append("the gradient is not on the CPU")
    fp8 = states[0].dtype if states[0] is not None else None
    if log:
        want["exp_avg_fp8"] = (want["exp_avg_fp8"][0], torch.int8)
        want["exp_avg_sq_fp8"] = (want["exp_avg_sq_fp8"][0], torch.uint8)
    elif fp8 not in (torch.float8_e4m3fn, torch.float8_e5m2):
        problems.append(f"exp_avg_fp8 has dtype {fp8}, not an fp8 dtype")
    for (key, (shape, dtype)), t in zip(want.items(), states, strict=True):
        absent = key == "exp_avg_exponent" if log else ("exponent" in key and not expand)
        if absent:
            if t is not None:
                problems.append(f"{key} is present in this moment format")
            continue
        if t is None:
            problems.append(f"{key} is missing")
            continue
        dtype = fp8 if dtype is None else dtype
        if tuple(t.shape) != shape or t.dtype != dtype:
            problems.append(f"{key} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
        if t.device.type != "cpu" or not t.is_contiguous():
            problems.append(f"{key} is not a contiguous CPU tensor")
    if hp.dtype != torch.float32 or hp.numel() != len(_step.HP_FIELDS) or not hp.is_contiguous():
        problems.append(f"hyper-parameters must be {len(_step.HP_FIELDS)} contiguous fp32 values")
    if problems:
        raise ValueError(
            "AdamWFp8 CPU kernel: refusing a parameter whose state does not match it: "
            + "; ".join(problems)
            + ". Reset this parameter's state (optimizer.state.pop(param)) or load a state "
            "saved for this model."
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
        *,
        keys: tuple[int, int] = (0, 0),
        sqrt_v: bool = False,
        sr_m: bool = False,
        sr_v: bool = False,
        log: bool = False,
    ) -> None:
        """Queue the step of a contiguous ``param``; ``copy_to`` receives it after the run.

        ``keys``: the uint32 stream keys of the two moments (stochastic rounding)."""
        grad = grad.contiguous()
        check_tensors(param, grad, states, hp, cols, group_size, expand, log)
        self.keep_alive += [param, grad, hp]
        tensors = dict(zip(("m_q", "m_s", "m_k", "v_q", "v_s", "v_k"), states, strict=True))
        tensors.update(p=param, g=grad, hp=hp)
        fields = {
            "rows": param.shape[0],
            "cols": cols,
            "group_size": group_size,
            "flags": variant(
                param.dtype,
                grad.dtype,
                states[0].dtype,
                expand,
                sqrt_v=sqrt_v,
                sr_m=sr_m,
                sr_v=sr_v,
                log=log,
            ),
            "key_m": keys[0] & 0xFFFFFFFF,
            "key_v": keys[1] & 0xFFFFFFFF,
        }
        for name, t in tensors.items():
            fields[name] = 0 if t is None else t.data_ptr()
            fields[f"{name}_n"] = 0 if t is None else t.numel()
        self.tasks.append([fields[name] for name in TASK_FIELDS])
        if copy_to is not None and copy_to is not param:
            self.copy_back.append((copy_to, param))

    def run(self) -> None:
        if self.tasks:
            launch(self.tasks)
        for dst, src in self.copy_back:
            dst.copy_(src)


class KernelStepError(RuntimeError):
    """The C kernel did not run a step. ``applied``: whether some tensors (another variant's
    tasks of the same step) were already updated; when ``False`` nothing was touched and the
    step can be retried."""

    def __init__(self, message: str, applied: bool) -> None:
        super().__init__(message)
        self.applied = applied


def launch(tasks: list[list[int]]) -> None:
    """Run the step on every task (``len(TASK_FIELDS)`` int64 each), one call per variant.

    Every library is loaded before the first call, and a call that refuses its tasks (invalid,
    out of memory) touches nothing, so a failure leaves the tensors as they were unless an
    earlier variant's call already ran (:class:`KernelStepError` says which)."""
    flags = TASK_FIELDS.index("flags")
    by_variant: dict[int, list[int]] = {}
    for task in tasks:
        if len(task) != len(TASK_FIELDS):
            raise ValueError(f"a task has {len(task)} fields, expected {len(TASK_FIELDS)}")
        by_variant.setdefault(task[flags], []).extend(task)
    libs = {var: load(var) for var in by_variant}
    for var, lib in libs.items():
        if lib is None:
            raise KernelStepError(f"CPU kernel unavailable: {error(var)}", applied=False)
    applied = False
    for var, flat in by_variant.items():
        arr = (ctypes.c_int64 * len(flat))(*flat)
        n = len(flat) // len(TASK_FIELDS)
        rc = libs[var].adamw_fp8_step(n, ctypes.cast(arr, ctypes.c_void_p), torch.get_num_threads())
        if rc != 0:
            partly = (
                "; the parameters of another dtype were already updated by this step: restore "
                "a checkpoint rather than retry it"
                if applied
                else ""
            )
            raise KernelStepError(
                f"CPU kernel refused its tasks (code {rc}: {ERRORS.get(rc, 'unknown')}){partly}",
                applied=applied,
            )
        applied = True
