"""The C CPU kernels (``csrc/fp8_gemv.c``): code-path choice, checked calls, torch custom ops.

Built once per code path with :func:`hf_fp8.utils.native.load_library` (the shared,
hardened loader; cached per machine):

* ``fp8_gemv``: a fused decode-and-reduce for up to 16 tokens. It streams the fp8 weight
  once, decodes it in registers (exactly, subnormal codes included), accumulates in fp32
  and applies the activation scale, the weight scale and the bias in the emulation's
  epilogue order.
* ``fp8_decode``: a vectorized fp8 → bf16 / fp32 weight decode (scale folded in, or not),
  bit-identical to ``dequantize`` / ``w_fp8.float().to(dtype)``; it feeds torch's matmul
  tile by tile (``cpu_fp8_mm``), followed by ``fp8_epilogue`` (the emulation's scales and
  bias in one pass).
* ``fp8_quant_act``: the activation fake-quantization, bit-identical to ``hf_fp8.numerics``.
* ``fp8_mm_bf16`` (``avx512bf16`` path): decode and matmul fused for many bf16 tokens: a
  register-blocked bf16 GEMM (``vdpbf16ps``) in which the weight is the broadcast operand, so
  a panel of 14 rows is only decoded into L1 (never transposed or packed) while the far
  smaller activation is packed once per call (by all threads together; dynamic per-token,
  dynamic per-tensor and static activations are fake-quantized while packed, bit-identical
  to ``fp8_quant_act``); then the same epilogue. It replaces decode + ``F.linear`` per tile where oneDNN has no AMX to beat it
  (:func:`fused_mm_enabled`).

Work is spread over ``torch.get_num_threads()`` threads of torch's own OpenMP team.

Code path, chosen at run time from the CPU: ``avx512bf16`` (AVX-512 + VBMI + BF16: byte-table
decode, bf16 dot products for bf16 activations), ``avx512`` (AVX-512 F/BW/VL/DQ + F16C + FMA),
``avx2`` (AVX2 + F16C + FMA), ``neon`` (aarch64), ``scalar`` (portable C). The environment
variable ``HF_FP8_CPU_KERNEL`` forces one (``avx512bf16``, ``avx512``, ``avx2``, ``neon``,
``scalar``) or turns the C kernels off (``off``: the compiled emulation runs instead).
Without a C compiler the kernels are unavailable and the emulation runs, with one warning.

The Python side checks every dtype, shape and contiguity before a call (the C code trusts
its sizes). The GEMV and the tiled matmul are torch custom ops (``hf_fp8::cpu_gemv``,
``hf_fp8::cpu_fp8_mm``) with fake implementations: ``torch.compile(fullgraph=True)`` keeps
them in one graph.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from hf_fp8.numerics.formats import min_scale
from hf_fp8.recipe import MAX_BLOCK
from hf_fp8.utils.native import cpu_features, load_library

logger = logging.getLogger("hf_fp8")

SOURCE = Path(__file__).parent / "csrc" / "fp8_gemv.c"
ENV = "HF_FP8_CPU_KERNEL"
PATHS = ("avx512bf16", "avx512", "avx2", "neon", "scalar")  # widest first
_PATH_ID = {"avx512bf16": 4, "avx512": 3, "avx2": 2, "neon": 1, "scalar": 0}
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mf16c", "-mfma")
_PATH_CFLAGS = {
    "avx512bf16": (*_AVX512, "-mavx512vbmi", "-mavx512bf16"),
    "avx512": _AVX512,
    "avx2": ("-mavx2", "-mf16c", "-mfma", "-mno-avx512f"),  # AVX2 code even on AVX-512
    "neon": (),
    "scalar": (),
}
# Paths built in two parts by two concurrent compiler processes (where this process may use
# two CPUs), then linked (csrc/fp8_gemv.c's FP8_PART): the fused decode + GEMM with the
# decode, and everything else. The avx512bf16 build is the largest (one compile ~1.5 s of CPU
# on a Zen4 core, each part ~1.0 s) and the first model forward may wait for it. Where every
# core is busy, two parts take longer than one compile (their total CPU is ~30 % more).
_PATH_PARTS = {"avx512bf16": ({"FP8_PART": 1}, {"FP8_PART": 2})}
BF16_ACTIVATION_PATHS = ("avx512bf16",)  # the GEMV takes exact bf16 activations there
GEMV_MAX_TOKENS = 16  # the C kernel's limit (and where it stops beating decode + matmul)
FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
GRANULARITIES = {"tensor": 0, "row": 1, "block": 2}
_ASCALE = {None: 0, "tensor": 1, "token": 2}
_OUT = {torch.float32: 0, torch.bfloat16: 1}
# bytes of decoded weight per matmul tile: twice a core's L2 (1 MiB here); smaller tiles make
# oneDNN's per-call overhead dominate (bench: 1 MiB 1.13x, 2 MiB 1.08x bf16 at M=256)
TILE_BYTES = 2 << 20

_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}
_FAILED: dict[str, str] = {}
_WARNED: set[str] = set()


def supported_paths() -> tuple[str, ...]:
    """Code paths this CPU can run, widest first (``scalar`` always, where C builds)."""
    feats = cpu_features()
    machine = platform.machine().lower()
    paths = []
    if machine in ("x86_64", "amd64"):
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2"} <= feats
        if avx512 and {"avx512vbmi", "avx512bf16"} <= feats:
            paths.append("avx512bf16")
        if avx512:
            paths.append("avx512")
        if "avx2" in feats:
            paths.append("avx2")
    if machine in ("aarch64", "arm64"):
        paths.append("neon")
    paths.append("scalar")
    return tuple(paths)


def requested_path() -> str | None:
    """The path ``HF_FP8_CPU_KERNEL`` asks for: a name, ``None`` for ``off``, or ``"auto"``."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value in ("off", "0", "none", "false", "no"):
        return None
    if value != "auto" and value not in PATHS:
        raise ValueError(
            f"{ENV}={value!r} is not a CPU kernel path; use one of auto, off, {', '.join(PATHS)}"
        )
    return value


def _torch_openmp() -> int | None:
    """Address of ``GOMP_parallel`` in the OpenMP runtime torch has loaded (libgomp, or
    libiomp5's GNU entry points), so that the kernels share torch's intra-op threads;
    ``None`` (the kernels start POSIX threads) when torch runs no OpenMP runtime here."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for lib_path in sorted(p for p in mapped if ".so" in p):
        try:
            fn = ctypes.CDLL(lib_path).GOMP_parallel  # already loaded: the same instance
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def _cpus() -> int:
    """CPUs this process may run on (two compiler processes need two)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _build(path: str) -> ctypes.CDLL:
    start = time.perf_counter()
    lib = load_library(
        f"fp8_gemv_{path}",
        SOURCE,
        defines={"FP8_PATH": str(_PATH_ID[path])},
        cflags=_PATH_CFLAGS[path],
        parts=_PATH_PARTS.get(path, ()) if _cpus() >= 2 else (),
    )
    seconds = time.perf_counter() - start
    if seconds > 0.3:  # a compile, not a cache hit: say so, once
        log = logger.warning if seconds > 1.0 else logger.info
        log(
            "hf_fp8: built the CPU FP8 kernel (%s path) in %.1f s; this happens once per "
            "machine (cached in $HF_FP8_CACHE or ~/.cache/hf_fp8)",
            path,
            seconds,
        )
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.fp8_gemv.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, ptr]
    lib.fp8_gemv.argtypes += [i64, i64, i64, i64]
    lib.fp8_decode.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64]
    lib.fp8_quant_act.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, i64]
    lib.fp8_quant_act.argtypes += [ctypes.c_float, i64]
    for fn in (
        lib.fp8_gemv,
        lib.fp8_decode,
        lib.fp8_quant_act,
        lib.fp8_kernel_path,
        lib.fp8_cpu_ok,
    ):
        fn.restype = ctypes.c_int
    lib.fp8_epilogue.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64]
    lib.fp8_epilogue.restype = ctypes.c_int
    lib.fp8_mm_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64]
    lib.fp8_mm_bf16.argtypes += [ptr, ptr, i64, i64, i64, ctypes.c_float, i64]
    lib.fp8_mm_bf16.restype = ctypes.c_int
    lib.fp8_set_openmp.argtypes = [ptr]
    lib.fp8_set_openmp.restype = None
    gomp = _torch_openmp()
    if gomp is not None:
        lib.fp8_set_openmp(gomp)
    if lib.fp8_kernel_path() != _PATH_ID[path]:
        raise RuntimeError(f"the {path} CPU kernel library reports another path")
    if not lib.fp8_cpu_ok():
        raise RuntimeError(f"this CPU lacks an instruction set the {path} path needs")
    return lib


def library(path: str) -> ctypes.CDLL | None:
    """The built library of ``path``, or ``None`` (the reason: :func:`failure`)."""
    with _LOCK:
        if path not in _LIBS and path not in _FAILED:
            try:
                _LIBS[path] = _build(path)
            except Exception as err:  # no compiler, no loader, a refused cache: fall back
                _FAILED[path] = f"{type(err).__name__}: {err}"[:500]
        return _LIBS.get(path)


def failure(path: str) -> str | None:
    """Why :func:`library` returned ``None`` for ``path``."""
    return _FAILED.get(path)


_ACTIVE: dict[str, str | None] = {}

# The fused decode + GEMM (``fp8_mm_bf16``) for many tokens: ``None`` picks it where it runs
# (the ``avx512bf16`` path) unless the CPU has AMX, whose oneDNN matmul a vdpbf16ps GEMM
# cannot match; ``True`` / ``False`` force it on / off (tests, benchmarks).
FUSED_MM: bool | None = None
# bf16 products above the GEMV limit through an fp32 matmul of the same bf16 operands, rounded
# to bf16 once as the bf16 matmul rounds them (fp32 sums both ways): where torch's bf16 matmul
# has no fast kernel (oneDNN without bf16 support: AVX2 CPUs such as AMD Zen 1-3), it runs at
# about 1/5 of the fp32 matmul (benchmarks/bench_linear.py). None: decided from the CPU.
BF16_VIA_FP32: bool | None = None


def bf16_matmul_via_fp32() -> bool:
    """Whether bf16 decode + matmul products run as fp32 matmuls (see ``BF16_VIA_FP32``)."""
    if BF16_VIA_FP32 is not None:
        return BF16_VIA_FP32
    return not _mkldnn_bf16()


@functools.cache
def _mkldnn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: its bf16 matmul
        return True


def fused_mm_enabled(path: str) -> bool:
    """Whether many-token bf16 products take the fused decode + GEMM on ``path``."""
    if path not in BF16_ACTIVATION_PATHS:
        return False
    if FUSED_MM is not None:
        return FUSED_MM
    return "amx_bf16" not in cpu_features()


@torch.compiler.assume_constant_result
def active_path() -> str | None:
    """The path the kernels use now: the forced one, else the widest that builds; ``None``
    when off or unavailable (then the compiled emulation runs). Cached per value of
    ``HF_FP8_CPU_KERNEL``; a constant for ``torch.compile``."""
    env = os.environ.get(ENV, "")
    if env not in _ACTIVE:
        _ACTIVE[env] = _choose_path()
    return _ACTIVE[env]


def _choose_path() -> str | None:
    want = requested_path()
    if want is None:
        return None
    supported = supported_paths()
    if want != "auto":
        if want not in supported:
            raise ValueError(
                f"{ENV}={want!r}: this CPU runs only {', '.join(supported)}; unset it or pick one"
            )
        candidates: tuple[str, ...] = (want,)
    else:
        candidates = supported
    for path in candidates:
        if library(path) is not None:
            return path
    reasons = "; ".join(f"{p}: {failure(p)}" for p in candidates)
    if reasons not in _WARNED:
        _WARNED.add(reasons)
        warnings.warn(
            f"hf_fp8: the C CPU FP8 kernels are unavailable ({reasons}); using the slower "
            f"compiled emulation. Install a C compiler (cc/gcc/clang, or set $CC), or set "
            f"{ENV}=off to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


_PREBUILD: list[threading.Thread] = []


def prebuild() -> threading.Thread | None:
    """Build (or load) the CPU kernel in a background thread, so that a model loaded for
    CPU inference finds it ready at its first forward. Idempotent; returns the thread."""
    with _LOCK:
        if not _PREBUILD:

            def body() -> None:
                with contextlib.suppress(ValueError):  # a bad HF_FP8_CPU_KERNEL: said later
                    active_path()

            thread = threading.Thread(target=body, name="hf_fp8-cpu-kernel-build", daemon=True)
            _PREBUILD.append(thread)
            thread.start()
        return _PREBUILD[0]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(cond: bool, message: str | Callable[[], str]) -> None:
    """Raise a ValueError with ``message`` (or ``message()``: formatted only on failure, for
    the per-call checks of the hot paths) unless ``cond``."""
    if not cond:
        raise ValueError(f"hf_fp8 CPU kernel: {message() if callable(message) else message}")


def _backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every byte its (contiguous) shape names: FSDP2 frees an
    unsharded parameter by resizing its storage to 0 and keeps the shape (R25 F7: a dropped
    pre-backward hook made the backward decode read such a weight: segfault)."""
    need = (t.storage_offset() + t.numel()) * t.element_size()
    return t.untyped_storage().nbytes() >= need


def _check_weight(w: torch.Tensor, w_scale: torch.Tensor | None, gran: str, bn: int, bk: int):
    _check(
        w.device.type == "cpu" and w.dtype in FORMATS,
        lambda: f"weight must be CPU fp8, got {w.dtype}",
    )
    _check(
        w.dim() == 2 and w.is_contiguous(),
        lambda: f"weight must be contiguous 2-D, {tuple(w.shape)}",
    )
    _check(
        _backed(w) and (w_scale is None or _backed(w_scale)),
        lambda: (
            f"weight {tuple(w.shape)} (or its scale) has a storage smaller than its shape: "
            "freed (FSDP2 reshards parameters after forward; an in-place op on an FSDP2 "
            "module's view output drops the hook that gathers them again for backward): use "
            "an out-of-place op there (out = out + y)"
        ),
    )
    _check(
        gran in GRANULARITIES, lambda: f"weight granularity {gran!r} not in {tuple(GRANULARITIES)}"
    )
    _check(
        1 <= bn <= MAX_BLOCK and 1 <= bk <= MAX_BLOCK,
        lambda: f"block size must be in [1, {MAX_BLOCK}], got {(bn, bk)}",
    )
    if w_scale is None:
        return
    n, k = w.shape
    want = {"tensor": 1, "row": n, "block": -(-n // bn) * -(-k // bk)}[gran]
    _check(
        w_scale.dtype == torch.float32 and w_scale.is_contiguous() and w_scale.numel() == want,
        lambda: (
            f"{gran} weight scale must be {want} contiguous float32 values, got "
            f"{tuple(w_scale.shape)} {w_scale.dtype}"
        ),
    )
    _check(w_scale.device.type == "cpu", "weight scale must be on the CPU")


def _gemv_impl(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_gran: str,
    bn: int,
    bk: int,
    a_gran: str | None,
    out_dtype: torch.dtype,
    path: str,
) -> torch.Tensor:
    _check_weight(w, w_scale, w_gran, bn, bk)
    n, k = w.shape
    _check(
        a.dtype in (torch.float32, torch.bfloat16)
        and a.dim() == 2
        and a.is_contiguous()
        and a.device.type == "cpu",
        lambda: f"activation must be contiguous 2-D CPU float32, got {tuple(a.shape)} {a.dtype}",
    )
    _check(
        a.dtype == torch.float32 or path in BF16_ACTIVATION_PATHS,
        lambda: f"bf16 activations need the {BF16_ACTIVATION_PATHS} path, not {path}",
    )
    m = a.shape[0]
    _check(
        1 <= m <= GEMV_MAX_TOKENS and a.shape[1] == k, lambda: f"activation {tuple(a.shape)} vs {k}"
    )
    _check(a_gran in _ASCALE, lambda: f"activation scale granularity {a_gran!r}")
    if a_gran is not None:
        assert a_scale is not None
        want = 1 if a_gran == "tensor" else m
        _check(
            a_scale.dtype == torch.float32
            and a_scale.is_contiguous()
            and a_scale.numel() == want
            and a_scale.device.type == "cpu",
            lambda: f"activation scale must be {want} contiguous float32 values",
        )
    if bias is not None:
        _check(
            bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == n,
            lambda: f"bias must be {n} contiguous float32 values",
        )
    lib = library(path)
    _check(lib is not None, lambda: f"the {path} path is unavailable: {failure(path)}")
    kind = _OUT.get(out_dtype, 0)
    out = torch.empty(m, n, dtype=torch.float32 if kind == 0 else out_dtype)
    rc = lib.fp8_gemv(
        a.data_ptr(), m, k, w.data_ptr(), n, w_scale.data_ptr(), GRANULARITIES[w_gran], bn, bk,
        _ptr(a_scale) if a_gran is not None else None, _ASCALE[a_gran], _ptr(bias),
        out.data_ptr(), kind, FORMATS[w.dtype], int(a.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )  # fmt: skip
    _check(rc in (0, 1), lambda: f"fp8_gemv failed with code {rc}")
    # an output is +-inf / NaN: where its activation row is finite, maybe an overflow of the
    # unscaled-code sums; only those rows take the folded product
    rows = redo_rows(out, a, a_scale if a_gran else None) if rc == 1 else None
    out = out if out.dtype == out_dtype else out.to(out_dtype)
    if rows is not None and bool(rows.any()):
        redo = _folded_fp32(a, w, w_scale, a_scale if a_gran else None, bias, w_gran, bn, bk,
                            out_dtype, path)  # fmt: skip
        out[rows] = redo[rows]
    return out


def _folded_fp32(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_gran: str,
    bn: int,
    bk: int,
    out_dtype: torch.dtype,
    path: str,
) -> torch.Tensor:
    """The GEMV's product again with every scale folded into fp32 operands (the emulation's
    fp32 route: ``dequantize``'s rounding of activation and weight, fp32 matmul, bias).

    The GEMV multiplies activations by *unscaled* codes (up to 448) and applies the weight
    scale after the sum (block scales: after each K-block's partial sum): with activations
    near ``FLT_MAX / 448`` the sums overflow to +-inf where the dequantized product is finite
    (R24 F1 / F2). The kernel reports any non-finite output (one compare per output, free on
    the normal path), and only then is the call redone here; where the inputs themselves are
    not finite the redo would give the same +-inf / NaN (measured 3.4-5.4x the GEMV's cost at
    one token, 4096 x 4096, R28 C), so it runs only where :func:`redo_rows` finds a row, and
    only those rows are kept from it: the other tokens keep their bits (R38 F1)."""
    a32 = a.float()
    if a_scale is not None:  # [1] (per tensor) or [m] (per token)
        a32 = a32 * a_scale.reshape(-1, 1)
    out = _fp8_mm_impl(a32.contiguous(), w, w_scale, None, bias, w_gran, bn, bk, False, path)
    return out.to(out_dtype)


def redo_rows(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor | None) -> torch.Tensor:
    """The rows (bool ``[M]``) of a product whose redo with folded scales could change them:
    the row of ``out`` ``[M, N]`` is not finite while its activation row of ``a`` ``[M, K]``
    (and its scale: ``a_scale`` with 1, M or M x blocks values) is. A NaN / inf activation
    gives a non-finite output row on the folded route as well (as an operand, or as the raw
    input of any quantization, static included: ``saturated_cast`` makes it a NaN code), so
    a non-finite input costs no second product (R28 C). Only these rows are replaced by the
    redo: every other token keeps the bits it has in a batch without the bad one (R38 F1;
    per-token scales promise that independence). Runs only after the kernel reported a
    non-finite output."""
    bad = ~finite_rows(out)
    ok = finite_rows(a)
    if a_scale is not None:
        if a_scale.numel() == 1:
            ok = ok & a_scale.isfinite().all()
        else:
            ok = ok & a_scale.reshape(a.shape[0], -1).isfinite().all(1)
    return bad & ok


def finite_rows(t: torch.Tensor) -> torch.Tensor:
    """``t.isfinite().all(1)`` for a 2-D eager tensor, about 20x faster for bf16 (torch's bf16
    ``isfinite`` is not vectorized: 0.86 ms at 64 x 5632 on one core): a row's fp32 sum is
    non-finite where the row holds a NaN / inf, or where its finite values overflow fp32;
    only those rows are checked element by element."""
    ok = t.sum(1, dtype=torch.float32).isfinite()
    if not bool(ok.all()):
        rows = (~ok).nonzero().flatten()
        ok[rows] = t[rows].isfinite().all(1)
    return ok


def redo_helps(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor | None) -> bool:
    """Whether :func:`redo_rows` finds any row."""
    return bool(redo_rows(out, a, a_scale).any())


def _fold_activation(a: torch.Tensor, a_scale: torch.Tensor | None) -> torch.Tensor:
    """bf16 fp8 values times their scale, rounded once to bf16 (``dequantize``'s rounding)."""
    if a_scale is None:
        return a
    return (a.float() * a_scale.reshape(-1, 1)).to(torch.bfloat16).contiguous()


def decode(
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    w_gran: str,
    block_size: tuple[int, int],
    dtype: torch.dtype,
    *,
    rows: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """Rows ``rows`` (default all) of ``w`` in ``dtype`` (bf16 or fp32): ``w_fp8.float() *
    scale`` rounded once (``w_scale=None``: unscaled fp8 values), as ``dequantize``."""
    bn, bk = int(block_size[0]), int(block_size[1])
    _check_weight(w, w_scale, w_gran, bn, bk)
    _check(dtype in _OUT, f"decode to {dtype} is not implemented (bf16, float32)")
    r0, r1 = rows if rows is not None else (0, w.shape[0])
    _check(0 <= r0 <= r1 <= w.shape[0], f"rows {(r0, r1)} outside {w.shape[0]}")
    k = w.shape[1]
    if out is None:
        out = torch.empty(r1 - r0, k, dtype=dtype)
    _check(
        out.dtype == dtype and out.is_contiguous() and out.numel() >= (r1 - r0) * k,
        "decode buffer too small or of another dtype",
    )
    out = out.view(-1)[: (r1 - r0) * k].view(r1 - r0, k)
    path = path or active_path()
    lib = library(path) if path else None
    _check(lib is not None, "the C CPU kernels are unavailable")
    rc = lib.fp8_decode(
        w.data_ptr() + r0 * k, r1 - r0, k, r0, _ptr(w_scale), GRANULARITIES[w_gran], bn, bk,
        out.data_ptr(), _OUT[dtype], FORMATS[w.dtype], torch.get_num_threads(),
    )  # fmt: skip
    _check(rc == 0, f"fp8_decode failed with code {rc}")
    return out


def quantize_activation(
    x: torch.Tensor,
    input_scale: torch.Tensor | None,
    act_dtype: torch.dtype,
    gran: str,
    bk: int,
    out_dtype: torch.dtype,
    post: bool,
    path: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The emulation's ``_fake_quant_act`` in C, bit for bit: ``(fp8 values, scale)`` when
    ``post``, else ``(dequantized values, None)``; ``gran`` is a numerics name."""
    _check(
        x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.is_contiguous(),
        lambda: f"activation must be contiguous 2-D float32 / bf16, got {tuple(x.shape)} {x.dtype}",
    )
    _check(
        act_dtype in FORMATS and gran in GRANULARITIES and 1 <= bk <= MAX_BLOCK,
        lambda: f"activation recipe: {act_dtype}, {gran!r}, block size {bk}",
    )
    _check(out_dtype in _OUT, lambda: f"activation output dtype {out_dtype}")
    m, k = x.shape
    kb = -(-k // bk)
    if input_scale is not None:
        _check(gran == "tensor" and input_scale.numel() == 1, "a static scale is per tensor")
        scale = input_scale.detach().float().reshape(1).contiguous().clone()
    else:
        scale = torch.empty({"tensor": (1,), "row": (m, 1), "block": (m, kb)}[gran])
    _check(k >= 2, "K must be at least 2 (the tensor amax is reduced through the output)")
    out = torch.empty(m, k, dtype=out_dtype)
    lib = library(path)
    _check(lib is not None, lambda: f"the {path} path is unavailable: {failure(path)}")
    rc = lib.fp8_quant_act(
        x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, GRANULARITIES[gran], bk,
        FORMATS[act_dtype], scale.data_ptr(), int(input_scale is not None), out.data_ptr(),
        _OUT[out_dtype], int(post), min_scale(), torch.get_num_threads(),
    )  # fmt: skip
    _check(rc == 0, lambda: f"fp8_quant_act failed with code {rc}")
    return out, (scale if post else None)


def _fp8_mm_impl(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_gran: str,
    bn: int,
    bk: int,
    w_post: bool,
    path: str,
) -> torch.Tensor:
    """The emulation's decode + matmul, tile by tile: ``a @ decode(w, w_scale).T`` (scales
    folded), or with ``w_post`` and/or ``a_scale`` the unscaled product, in ``a.dtype``;
    then the emulation's epilogue (scales and bias added in fp32, one rounding)."""
    n, k = w.shape
    _check(a.dim() == 2 and a.shape[1] == k, lambda: f"activation {tuple(a.shape)} vs K={k}")
    _check(
        a.dtype == torch.bfloat16 or not (w_post or a_scale is not None),
        "scales after the matmul need bf16",
    )
    if a.dtype == torch.bfloat16 and k % 2 == 0 and fused_mm_enabled(path):
        return fused_mm(a, w, w_scale, a_scale, bias, w_gran, bn, bk, w_post, path)
    # bf16 operands in fp32 (exact) where the bf16 matmul is slow: the same products and fp32
    # sums, rounded to bf16 once per output as the bf16 matmul rounds them
    via_fp32 = a.dtype == torch.bfloat16 and bf16_matmul_via_fp32()
    mm_dtype = torch.float32 if via_fp32 else a.dtype
    rows = max(16, min(n, TILE_BYTES // (k * mm_dtype.itemsize) // 16 * 16))
    # out.T tile by tile (tile @ a.T: rows of out.T), joined by one cat. Measured with 2
    # threads: torch.mm(..., out=) and a @ tile.T per tile ran 5-10x slower than this.
    # Thread counts (R38 F4): torch's fp32 matmul splits some shapes' sums by thread count,
    # in either orientation (this one at 17 x 640 -> 300, nn.Linear's x @ w.T at
    # 256 x 96 -> 40, from 3 threads on; 1 and 2 threads agree), so fp32 results here may
    # differ by an ulp between thread counts as nn.Linear's may. a @ tile.T was re-timed
    # (R38, 1 thread: 0.73-1.0x at M = 17..256, K x N = 2048 x 5632 / 5632 x 2048), but at 2
    # threads on a loaded machine it measured 0.8-2.8x, so the orientation stays.
    buf = torch.empty(rows * k, dtype=a.dtype)
    buf32 = torch.empty(rows * k, dtype=torch.float32) if via_fp32 else None
    a_mm = a.float() if via_fp32 else a
    parts = []
    # without scales after the matmul the bias joins the fp32 sum before the one rounding to
    # bf16, as F.linear(a, w, bias) does (the epilogue would round twice)
    bias_in_mm = bias is not None and a.dtype == torch.bfloat16 and not w_post and a_scale is None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        scale = None if w_post else w_scale
        if via_fp32 and w_post:  # unscaled fp8 values: exact in fp32 as in bf16
            tile = decode(w, None, w_gran, (bn, bk), mm_dtype, rows=(r0, r1), out=buf32, path=path)
        else:  # folded scales: the emulation's bf16 operand, then exactly to fp32
            tile = decode(w, scale, w_gran, (bn, bk), a.dtype, rows=(r0, r1), out=buf, path=path)
            if via_fp32:
                tile = buf32[: tile.numel()].view(tile.shape).copy_(tile)
        if bias_in_mm:
            part = torch.addmm(bias[r0:r1, None].to(mm_dtype), tile, a_mm.t())
        else:
            part = torch.nn.functional.linear(tile, a_mm)
        # the fp32 route rounds each tile's products at once (elementwise: the same bits as
        # rounding the joined result), so only one fp32 tile of products is alive (R23 F3)
        parts.append(part.to(torch.bfloat16) if via_fp32 else part)
    out_t = parts[0] if len(parts) == 1 else torch.cat(parts)
    if a.dtype != torch.bfloat16:
        out = out_t.t()
        return (out if bias is None else out + bias).contiguous()
    # the epilogue (scales, bias, one rounding) and the transpose in C: one pass
    lib = library(path)
    _check(lib is not None, lambda: f"the {path} path is unavailable: {failure(path)}")
    ws = w_scale if w_post else None
    b = None if bias_in_mm else bias
    for t, name, want in (
        (a_scale, "activation scale", (1, a.shape[0])),
        (ws, "weight scale", (1, n)),
    ):
        _check(
            t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.numel() in want),
            f"{name} must be float32 with {want} values",
        )
    _check(
        b is None or (b.dtype == torch.bfloat16 and b.is_contiguous() and b.numel() == n),
        lambda: f"bias must be {n} contiguous bf16 values",
    )
    out = torch.empty(a.shape[0], n, dtype=torch.bfloat16)
    rc = lib.fp8_epilogue(
        out_t.data_ptr(), a.shape[0], n, _ptr(a_scale), 0 if a_scale is None else a_scale.numel(),
        _ptr(ws), 0 if ws is None else ws.numel(), _ptr(b), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _check(rc in (0, 1), lambda: f"fp8_epilogue failed with code {rc}")
    if rc == 1 and (ws is not None or a_scale is not None):
        # an output is +-inf / NaN and the product multiplied unscaled codes (up to 448):
        # the rows of finite activations take the product with the scales folded into the
        # bf16 operands (see _folded_fp32); the others keep their bits
        rows = redo_rows(out, a, a_scale)
        if bool(rows.any()):
            a_f = _fold_activation(a, a_scale)
            redo = _fp8_mm_impl(a_f, w, w_scale, None, bias, w_gran, bn, bk, False, path)
            out[rows] = redo[rows]
    return out


def fused_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_gran: str,
    bn: int,
    bk: int,
    w_post: bool,
    path: str,
    *,
    out: torch.Tensor | None = None,
    quantize: torch.dtype | None = None,
    quantize_gran: str = "row",
) -> torch.Tensor:
    """``_fp8_mm_impl`` for bf16 ``a`` and even K in one C call (``fp8_mm_bf16``): the
    same operands, products and epilogue; only the fp32 summation order differs. ``out``:
    an ``[m, n]`` bf16 tensor with contiguous rows (e.g. rows of a larger output) that the
    result is written into (eager callers only: it is not a custom op). ``quantize``: an
    fp8 dtype: ``a`` is the raw activation, fake-quantized inside the kernel while it is
    packed (one C call, one parallel region, no ``[m, k]`` temporary). With ``a_scale=None``
    (dynamic) exactly as :func:`quantize_activation` ``(a, None, quantize, quantize_gran, _,
    bf16, post=True)`` would (``quantize_gran``: ``"row"``, per token, or ``"tensor"``), its
    scales applied after the matmul; with a one-value ``a_scale`` (static, per tensor) exactly
    as ``quantize_activation(a, a_scale, quantize, "tensor", _, bf16, post=True)``,
    ``a_scale`` applied after the matmul."""
    _check_weight(w, w_scale, w_gran, bn, bk)
    n, k = w.shape
    _check(
        a.dim() == 2
        and a.shape[1] == k
        and a.shape[0] >= 1
        and a.dtype == torch.bfloat16
        and a.is_contiguous()
        and a.device.type == "cpu",
        lambda: (
            f"activation must be a contiguous CPU bf16 [M >= 1, {k}] tensor, got "
            f"{tuple(a.shape)} {a.dtype} on {a.device}"
        ),
    )
    m = a.shape[0]
    _check(k % 2 == 0, lambda: f"the fused matmul needs an even K, got {k}")
    _check(
        not w_post or w_gran in ("tensor", "row"),
        lambda: (
            f"weight scales after the matmul (w_post) are per tensor or per row, not {w_gran!r}"
        ),
    )
    ws = w_scale if w_post else None
    _check(
        quantize is None or (quantize in FORMATS and (a_scale is None or a_scale.numel() == 1)),
        lambda: (
            f"in-kernel quantization takes an fp8 dtype and no scale (dynamic) or one (static), "
            f"got {quantize} and {None if a_scale is None else tuple(a_scale.shape)}"
        ),
    )
    _check(
        quantize_gran in ("row", "tensor"),
        lambda: f"quantize_gran is 'row' (per token) or 'tensor', got {quantize_gran!r}",
    )
    _check(
        a_scale is None
        or (
            a_scale.dtype == torch.float32
            and a_scale.is_contiguous()
            and a_scale.device.type == "cpu"
            and a_scale.numel() in (1, m)
        ),
        lambda: f"activation scale must be CPU float32 with 1 or {m} values",
    )
    _check(ws is None or ws.numel() in (1, n), lambda: f"a post weight scale has 1 or {n} values")
    _check(
        bias is None
        or (
            bias.dtype == torch.bfloat16
            and bias.is_contiguous()
            and bias.device.type == "cpu"
            and bias.numel() == n
        ),
        lambda: f"bias must be {n} contiguous CPU bf16 values",
    )
    lib = library(path)
    _check(lib is not None, lambda: f"the {path} path is unavailable: {failure(path)}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16)
    _check(
        out.dtype == torch.bfloat16
        and out.device.type == "cpu"
        and out.shape == (m, n)
        and out.stride() == (n, 1),
        lambda: (
            f"out must be a [{m}, {n}] CPU bf16 tensor with contiguous rows, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        ),
    )
    a0, o0 = a.data_ptr(), out.data_ptr()
    _check(
        o0 + out.numel() * 2 <= a0 or a0 + a.numel() * 2 <= o0,
        "out must not overlap the activation (the kernel reads a while it writes out)",
    )
    folded = None if w_post else w_scale
    rc = lib.fp8_mm_bf16(
        a.data_ptr(), m, k, w.data_ptr(), n, _ptr(folded), GRANULARITIES[w_gran], bn, bk,
        _ptr(a_scale), 0 if a_scale is None else a_scale.numel(), _ptr(ws),
        0 if ws is None else ws.numel(), _ptr(bias), out.data_ptr(), FORMATS[w.dtype],
        torch.get_num_threads(), -1 if quantize is None else FORMATS[quantize], min_scale(),
        GRANULARITIES["tensor" if a_scale is not None else quantize_gran],
    )  # fmt: skip
    _check(
        rc in (0, 1),
        lambda: f"fp8_mm_bf16 failed with code {rc} (-4: out of memory for its scratch)",
    )
    if rc == 1 and (w_post or a_scale is not None or quantize is not None):
        # an output is +-inf / NaN and the product multiplied unscaled codes (up to 448): the
        # rows of finite activations take the product with the scales folded into the bf16
        # operands (see _folded_fp32), the other tokens keep their bits (R38 F1). With
        # in-kernel quantization ``a`` is the raw input: a finite row has finite codes (they
        # saturate) and a finite scale (the amax skips NaN / inf, a static scale is checked),
        # a NaN / inf one a NaN code, so its row is NaN on both routes. The redo quantizes the
        # whole batch (a per-tensor scale is the batch's), as the two-step path does.
        rows = redo_rows(out, a, a_scale)
        if bool(rows.any()):
            if quantize is not None:
                gran = "tensor" if a_scale is not None else quantize_gran
                a_f, _ = quantize_activation(
                    a, a_scale, quantize, gran, bk, torch.bfloat16, False, path
                )
            else:
                a_f = _fold_activation(a, a_scale)
            redo = fused_mm(a_f, w, w_scale, None, bias, w_gran, bn, bk, False, path)
            out[rows] = redo[rows]
    return out


@torch.library.custom_op("hf_fp8::cpu_gemv", mutates_args=())
def cpu_gemv(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_gran: str,
    bn: int,
    bk: int,
    a_gran: str | None,
    out_dtype: torch.dtype,
    path: str,
) -> torch.Tensor:
    """``(a @ decode(w).T) * a_scale * w_scale + bias`` for ≤ 16 fp32 rows ``a``."""
    return _gemv_impl(a, w, w_scale, a_scale, bias, w_gran, bn, bk, a_gran, out_dtype, path)


@cpu_gemv.register_fake
def _(a, w, w_scale, a_scale, bias, w_gran, bn, bk, a_gran, out_dtype, path):
    return a.new_empty(a.shape[0], w.shape[0], dtype=out_dtype)


@torch.library.custom_op("hf_fp8::cpu_fp8_mm", mutates_args=())
def cpu_fp8_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    a_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    w_gran: str,
    bn: int,
    bk: int,
    w_post: bool,
    path: str,
) -> torch.Tensor:
    """The emulation's decode + matmul (+ epilogue) for many tokens (see ``_fp8_mm_impl``)."""
    return _fp8_mm_impl(a, w, w_scale, a_scale, bias, w_gran, bn, bk, w_post, path)


@cpu_fp8_mm.register_fake
def _(a, w, w_scale, a_scale, bias, w_gran, bn, bk, w_post, path):
    return a.new_empty(a.shape[0], w.shape[0])
