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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task, _opt = captured_task(json.loads(args.options))
    variant = task[_cpu_kernel.TASK_FIELDS.index("flags")]
    libs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, src in enumerate(args.sources):
            path = Path(tmp) / f"ab_{i}.c"
            path.write_text(src.read_text() + ENTRY)
            lib = native.load_library(
                f"adamw_fp8_ab{i}",
                path,
                defines=_cpu_kernel.kernel_defines(variant),
                cflags=args.cflags.split(),
            )
            lib.ab_bench.restype = ctypes.c_double
            lib.ab_bench.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            libs.append(lib)
    arr = (ctypes.c_int64 * len(task))(*task)
    times: list[list[float]] = [[] for _ in libs]
    for _ in range(args.rounds):
        for t, lib in zip(times, libs, strict=True):
            t.append(lib.ab_bench(ctypes.cast(arr, ctypes.c_void_p), args.groups, args.inner))
    out: dict = {
        f"{i}:{src}": {
            "ns_per_group_min": round(min(t), 1),
            "ns_per_group_median": round(statistics.median(t), 1),
        }
        for i, (src, t) in enumerate(zip(args.sources, times, strict=True))
    }
    first = times[0]
    for i, (src, t) in enumerate(zip(args.sources, times, strict=True)):
        out[f"{i}:{src}"]["ratio_min"] = round(min(t) / min(first), 3)
        out[f"{i}:{src}"]["ratio_median"] = round(
            statistics.median(t) / statistics.median(first), 3
        )
    out["cflags"] = args.cflags
    out["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
