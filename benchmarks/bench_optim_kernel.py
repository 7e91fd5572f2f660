"""A/B timing of C-kernel sources of the AdamWFp8 step, interleaved, in thread CPU time.

Step-level timings on a shared machine move by 10-50 % with the other processes; this
compares kernel *sources* (e.g. the committed ``hf_fp8/optim/csrc/adamw_fp8.c`` against an
edited copy) on one captured task, the embedding-sized parameter of ``bench_optim.py``
(16384 x 1024, state after a few steps), round-robin, one thread, thread CPU time. ``--groups``
limits the task to its first groups (in-cache: compute only); 0 streams the whole tensor.
Each source is built with the kernel's own defines and ``hf_fp8.utils.native``'s flags, run
through its ``dispatch`` (the variant of the optimizer's options), and reported as ns per
128-element group, min and median, with ratios against the first source. The results change
the state in place (each call is a step), which every source sees alike.

    python benchmarks/bench_optim_kernel.py old.c hf_fp8/optim/csrc/adamw_fp8.c --groups 512

``--cflags`` adds compiler flags to every source's build: ``--cflags=-march=znver1`` builds the
AVX2 loops with Zen 1's code generation (on any x86-64 machine that runs AVX2: the timing is
the host's, not Zen 1's), ``--cflags=-mno-avx512f`` the AVX2 loops tuned for the host.

``--stages`` also times each source with a stage left out (the requantization of m, of v, the
update loop, all three: what remains is the decode tables, the per-group constants, the
prefetches and the loops) and reports each stage's share as the difference, in ns per group
and in cycles per element at ``--ghz``. ``--floor`` times, on the same 128-element groups in
L1, only the fp32 operations the reference prescribes in this order (no FMA: the kernel stays
bit-identical to separately rounded torch operations): AdamW's update (14 operations, a square
root and a division per element) and, per moment, flog2, the expansion and fast_exp2's
polynomial (23 operations), with nothing else (no decode, exponent extraction, casts, random
bits, reductions, tables or memory streams): a floor no exact kernel goes below.

    python benchmarks/bench_optim_kernel.py hf_fp8/optim/csrc/adamw_fp8.c --stages --floor
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_optim import make_params  # noqa: E402
from hf_fp8.optim import AdamWFp8, _cpu_kernel, _step  # noqa: E402
from hf_fp8.utils import native  # noqa: E402

ENTRY = r"""
#include <time.h>
double ab_bench(const int64_t* t, int64_t nlim, int inner) {
    const int64_t ng0 = task_groups(t), ng = nlim && nlim < ng0 ? nlim : ng0;
    /* 64-byte aligned, as adamw_fp8_step's scratch */
    float* buf = aligned_alloc(64, (2 * CHUNK * t[T_GROUP_SIZE] * sizeof(float) + 63) & ~63ull);
    struct timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    for (int i = 0; i < inner; ++i) dispatch(t, 0, ng, buf, buf + CHUNK * t[T_GROUP_SIZE]);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    free(buf);
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / inner / ng;
}
"""


FLOOR = r"""
#include <immintrin.h>
#include <time.h>
#define S(x) _mm512_set1_ps(x)
static float fl_p[128], fl_g[128], fl_m[128], fl_v[128], fl_q[256] __attribute__((aligned(64)));
static double fl_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}
/* flog2 (mantissa - 1, 6 multiplications and 6 additions), y = (lx - lmax)·k + log2 F and
   fast_exp2's y - floor(y) and polynomial, 8 vectors interleaved as in the kernel */
static void fl_chain(const float* x, float* out) {
    __m512 t[8], a[8], y[8], f[8];
    for (int u = 0; u < 8; ++u) t[u] = _mm512_sub_ps(_mm512_load_ps(x + 16 * u), S(1.0f));
    for (int u = 0; u < 8; ++u) a[u] = _mm512_add_ps(_mm512_mul_ps(t[u], S(LOG2_C5)), S(LOG2_C4));
    for (int u = 0; u < 8; ++u) a[u] = _mm512_add_ps(_mm512_mul_ps(a[u], t[u]), S(LOG2_C3));
    for (int u = 0; u < 8; ++u) a[u] = _mm512_add_ps(_mm512_mul_ps(a[u], t[u]), S(LOG2_C2));
    for (int u = 0; u < 8; ++u) a[u] = _mm512_add_ps(_mm512_mul_ps(a[u], t[u]), S(LOG2_C1));
    for (int u = 0; u < 8; ++u) a[u] = _mm512_add_ps(_mm512_mul_ps(a[u], t[u]), S(LOG2_C0));
    for (int u = 0; u < 8; ++u) {
        __m512 lx = _mm512_add_ps(S(-3.0f), _mm512_mul_ps(a[u], t[u]));
        y[u] = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(lx, S(2.0f)), S(1.5f)), S(E4M3_LOG2MAX));
    }
    for (int u = 0; u < 8; ++u) {
        f[u] = _mm512_reduce_ps(y[u], _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        a[u] = _mm512_add_ps(_mm512_mul_ps(f[u], S(EXP2_C3)), S(EXP2_C2));
    }
    for (int u = 0; u < 8; ++u) a[u] = _mm512_add_ps(_mm512_mul_ps(a[u], f[u]), S(EXP2_C1));
    for (int u = 0; u < 8; ++u) a[u] = _mm512_add_ps(_mm512_mul_ps(a[u], f[u]), S(EXP2_C0));
    for (int u = 0; u < 8; ++u)
        _mm512_store_ps(out + 16 * u, _mm512_add_ps(_mm512_mul_ps(a[u], f[u]), S(1.0f)));
}
/* ns per 128-element group: out[0] AdamW's update, out[1] the two moments' chains */
void floor_bench(long iters, double* out) {
    for (int i = 0; i < 128; ++i) {
        fl_p[i] = 1.0f + i * 1e-3f; fl_g[i] = 1e-3f * (i - 64); fl_m[i] = 1.25f; fl_v[i] = 1.5f;
        fl_q[i] = 1e-4f; fl_q[128 + i] = 1e-6f;
    }
    out[0] = out[1] = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
        double t0 = fl_now();
        for (long it = 0; it < iters; ++it) {
            for (int i = 0; i < 128; i += 16) {
                __m512 g = _mm512_load_ps(fl_g + i), p = _mm512_load_ps(fl_p + i);
                __m512 mo = _mm512_load_ps(fl_q + i), vo = _mm512_load_ps(fl_q + 128 + i);
                __m512 mn = _mm512_add_ps(mo, _mm512_mul_ps(S(0.1f), _mm512_sub_ps(g, mo)));
                __m512 vn = _mm512_add_ps(_mm512_mul_ps(vo, S(0.999f)),
                                          _mm512_mul_ps(_mm512_mul_ps(S(0.001f), g), g));
                __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vn), S(1.1f)), S(1e-8f));
                __m512 pn = _mm512_sub_ps(_mm512_mul_ps(p, S(0.99999f)),
                                          _mm512_div_ps(_mm512_mul_ps(S(1e-3f), mn), den));
                _mm512_store_ps(fl_p + i, pn);
                _mm512_store_ps(fl_m + i, mn);
                _mm512_store_ps(fl_v + i, vn);
            }
            __asm__ volatile("" ::: "memory");
        }
        double t1 = fl_now();
        for (long it = 0; it < iters; ++it) {
            fl_chain(fl_m, fl_q + 0);
            fl_chain(fl_v, fl_q + 128);
            __asm__ volatile("" ::: "memory");
        }
        double t2 = fl_now();
        if ((t1 - t0) / iters < out[0]) out[0] = (t1 - t0) / iters;
        if ((t2 - t1) / iters < out[1]) out[1] = (t2 - t1) / iters;
    }
}
"""

# --stages: the stage left out of run_groups (a text substitution of the source; the source
# must have the calls as written in the kernel since the AVX-512 rewrite)
REQUANT_M = """            requant(mb + j * gs, mq + (g0 + j) * gs, nn[j], gs, EX ? km[j] : 0.0f,
                    EX ? lm[j] : 0.0f, am[j], b2f(mmin[j]), key_m + e0, E5, EX, SRM, 0);"""
REQUANT_V = """            requant(vb + j * gs, vq + (g0 + j) * gs, nn[j], gs, EX ? kv[j] : 0.0f,
                    EX ? lv[j] : 0.0f, av[j], b2f(vmin[j]), key_v + e0, E5, EX, SRV, 1);"""
UPDATE = """#if HAVE_DEC_AVX512
            if (EX && !E5 && n % 16 == 0) /* E4M3 codes with expansion: 16 lanes */"""
# the update left out: fixed maxima / minima of |m| and v (k, scales: realistic constants)
NO_UPDATE = (
    "            if (1) { red[0] = 0x3A800000u; red[1] = 0x33800000u; red[2] = 0x36800000u;"
    " red[3] = 0x2B800000u; } else\n"
)
STAGES = {
    "no_requant_m": ((REQUANT_M, ""),),
    "no_requant_v": ((REQUANT_V, ""),),
    "no_update": ((UPDATE, NO_UPDATE + UPDATE),),
    "tables_only": ((REQUANT_M, ""), (REQUANT_V, ""), (UPDATE, NO_UPDATE + UPDATE)),
}


def stage_source(text: str, stage: str) -> str:
    for old, new in STAGES[stage]:
        if text.count(old) != 1:
            raise SystemExit(
                f"--stages: the source has no single {old.split('(')[0].strip()!r} call"
            )
        text = text.replace(old, new)
    return text


def captured_task(options: dict) -> tuple[list[int], tuple[AdamWFp8, torch.Tensor]]:
    """The kernel task of the largest parameter after a few steps with ``options``, and what
    it points into (keep it alive while the task runs): the optimizer, and a copy of the
    step's hyper-parameters, whose own tensor is a temporary freed after the step (a task
    left pointing at it ran with whatever the allocator put there: a step size of 3e-41
    and a decay of -2e-35 were seen, whose denormal products slowed the update loop 20 %)."""
    opt = AdamWFp8(make_params(), **options)
    for _ in range(3):
        opt.step()
    tasks: list[list[int]] = []
    hps: list[torch.Tensor] = []
    hp_field = _cpu_kernel.TASK_FIELDS.index("hp")

    def capture(batch: list[list[int]]) -> None:
        for task in batch:
            values = (ctypes.c_float * len(_step.HP_FIELDS)).from_address(task[hp_field])
            hps.append(torch.tensor(list(values), dtype=torch.float32))
            tasks.append([*task[:hp_field], hps[-1].data_ptr(), *task[hp_field + 1 :]])

    launch = _cpu_kernel.launch
    _cpu_kernel.launch = capture
    try:
        opt.step()
    finally:
        _cpu_kernel.launch = launch
    i = max(range(len(tasks)), key=lambda i: tasks[i][_cpu_kernel.TASK_FIELDS.index("p_n")])
    return tasks[i], (opt, hps[i])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="+", type=Path, help="kernel C sources to compare")
    parser.add_argument("--groups", type=int, default=512, help="groups per call (0: all)")
    parser.add_argument("--inner", type=int, default=4, help="calls per timing")
    parser.add_argument("--rounds", type=int, default=100, help="round-robin rounds")
    parser.add_argument("--options", default="{}", help="AdamWFp8 options as JSON")
    parser.add_argument(
        "--cflags",
        default="",
        help="extra compiler flags of every source, space-separated: '-mno-avx512f' times "
        "the AVX2 loops on a machine with AVX-512",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="also time each source without the requantization of m, of v, the update, all three",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time only the fp32 operations the reference prescribes (AVX-512 machines)",
    )
    parser.add_argument("--ghz", type=float, default=2.6, help="core clock for cycles/element")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task, _opt = captured_task(json.loads(args.options))
    variant = task[_cpu_kernel.TASK_FIELDS.index("flags")]
    builds = [(f"{i}:{src}", src.read_text()) for i, src in enumerate(args.sources)]
    if args.stages:
        builds += [
            (f"{name}/{stage}", stage_source(text, stage))
            for name, text in builds
            for stage in STAGES
        ]
    libs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (_name, text) in enumerate(builds):
            path = Path(tmp) / f"ab_{i}.c"
            path.write_text(text + ENTRY)
            lib = native.load_library(
                f"adamw_fp8_ab{i}",
                path,
                defines=_cpu_kernel.kernel_defines(variant),
                cflags=args.cflags.split(),
            )
            lib.ab_bench.restype = ctypes.c_double
            lib.ab_bench.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            libs.append(lib)
        floor_lib = None
        if args.floor:
            path = Path(tmp) / "floor.c"
            path.write_text(FLOOR)
            floor_lib = native.load_library(
                "adamw_fp8_floor", path, defines=_cpu_kernel.kernel_defines(variant)
            )
    arr = (ctypes.c_int64 * len(task))(*task)
    times: list[list[float]] = [[] for _ in libs]
    for _ in range(args.rounds):
        for t, lib in zip(times, libs, strict=True):
            t.append(lib.ab_bench(ctypes.cast(arr, ctypes.c_void_p), args.groups, args.inner))
    out: dict = {
        name: {
            "ns_per_group_min": round(min(t), 1),
            "ns_per_group_median": round(statistics.median(t), 1),
        }
        for (name, _text), t in zip(builds, times, strict=True)
    }
    first = times[0]
    for (name, _text), t in zip(builds, times, strict=True):
        out[name]["ratio_min"] = round(min(t) / min(first), 3)
        out[name]["ratio_median"] = round(statistics.median(t) / statistics.median(first), 3)
    cycles = args.ghz / 128  # ns per 128-element group -> cycles per element
    if args.stages:
        for name, _text in builds[: len(args.sources)]:
            total = out[name]["ns_per_group_median"]
            ns = {
                "requant_m": total - out[f"{name}/no_requant_m"]["ns_per_group_median"],
                "requant_v": total - out[f"{name}/no_requant_v"]["ns_per_group_median"],
                "update": total - out[f"{name}/no_update"]["ns_per_group_median"],
                "tables_constants_prefetch": out[f"{name}/tables_only"]["ns_per_group_median"],
            }
            out[name]["stages_ns_per_group"] = {k: round(v, 1) for k, v in ns.items()}
            out[name]["stages_cycles_per_element"] = {
                k: round(v * cycles, 2) for k, v in ns.items()
            }
    if floor_lib is not None:
        res = (ctypes.c_double * 2)()
        floor_lib.floor_bench.argtypes = [ctypes.c_long, ctypes.c_void_p]
        floor_lib.floor_bench(200000, ctypes.cast(res, ctypes.c_void_p))
        out["floor_ns_per_group"] = {
            "update_arithmetic": round(res[0], 1),
            "requant_arithmetic_both_moments": round(res[1], 1),
            "sum": round(res[0] + res[1], 1),
        }
        out["floor_cycles_per_element"] = round((res[0] + res[1]) * cycles, 2)
    out["cflags"] = args.cflags
    out["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
