"""Step time and state memory of ``AdamWFp8`` against torch and torchao optimizers.

One parameter set of ≈29M parameters shaped like a small Llama layer plus embeddings
(hidden 1024, GQA k/v 256, MLP 3072, vocab 16384, two norms), fixed random gradients, and
for each optimizer its own copy of the parameters:

* ``torch.optim.AdamW`` foreach and fused (the baselines, fp32 states),
* torchao ``AdamWFp8`` and ``AdamW8bit`` (when torchao imports),
* ``hf_fp8.AdamWFp8`` with (``adamw_fp8_coat``, its default options: E4M3 codes with COAT
  expansion, stochastic rounding of ``v``) and without (``adamw_fp8``: plain FP8) expansion,
  and each moment-storage option of :data:`OPTION_VARIANTS` (the non-FP8 ``moment_format="log"``
  with round-to-nearest or stochastic rounding; the fp8 COAT codes with round-to-nearest).

Also reported: CPU time of one step on a single thread (robust to other processes, which
slow the many short parallel regions of foreach AdamW far more than one fused kernel), and
the wall time of the COAT step against ``torch.optim.AdamW(fused=True)`` — the real
competitor — at 1 and 2 threads (:func:`thread_sweep`; ``kernel_threads`` in the JSON says
whether the C kernel ran on torch's OpenMP pool or on POSIX threads).

The first step (state creation and compilation: torch.compile for torchao, the C kernel
for ``AdamWFp8``, built in a fresh cache directory so that the time is a cold start) is
timed separately; then the optimizers are timed interleaved, round by round, and the best
and median rounds are kept (robust to other processes on a shared machine). Ratios are
against ``torch.optim.AdamW(foreach=True)`` timed in the same run.

    python benchmarks/bench_optim.py            # writes benchmarks/results/optim.json
    python benchmarks/bench_optim.py --quick    # fewer rounds; optim_quick.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_fp8.optim import AdamWFp8, _cpu_kernel  # noqa: E402
from hf_fp8.optim._layout import is_quantized_state  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
HIDDEN, KV, MLP, VOCAB = 1024, 256, 3072, 16384
SHAPES = {
    "embed_tokens": (VOCAB, HIDDEN),
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (KV, HIDDEN),
    "v_proj": (KV, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (MLP, HIDDEN),
    "up_proj": (MLP, HIDDEN),
    "down_proj": (HIDDEN, MLP),
    "input_layernorm": (HIDDEN,),
    "post_attention_layernorm": (HIDDEN,),
}
# Moment-storage options timed beside the defaults (all with COAT expansion). The default
# adamw_fp8_coat is moment_format="fp8" with stochastic rounding of v ("fp8_coat_sr_v").
OPTION_VARIANTS = {
    "log_sr_v": {"moment_format": "log", "stochastic_rounding": "exp_avg_sq"},
    "log_rtn": {"moment_format": "log", "stochastic_rounding": False},
    "log_sr": {"moment_format": "log", "stochastic_rounding": True},
    "fp8_coat_rtn": {"moment_format": "fp8", "stochastic_rounding": False},
    "fp8_coat_sr_v": {"moment_format": "fp8", "stochastic_rounding": "exp_avg_sq"},
}
TARGETS = {
    "coat_vs_fused_adamw_max": 1.5,  # issue 15, at 1 and 2 threads
    "coat_step_vs_adamw_foreach_max": 1.0,
    "coat_speedup_vs_torchao_fp8_min": 3.0,
    "coat_first_step_s_max": 15.0,
    "bytes_per_param_quantized_max": 2.2,
}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (torchao's quantized states)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer, quantized_only: bool = False) -> tuple[int, int]:
    """(state bytes, parameter count) over the parameters (optionally quantized ones only)."""
    total = numel = 0
    for p, st in opt.state.items():
        if quantized_only and not is_quantized_state(st):
            continue
        total += sum(
            tensor_bytes(v) for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"
        )
        numel += p.numel()
    return total, numel


def candidates() -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer] | str]:
    """Optimizer factories by name; a string explains why a candidate is skipped."""
    out: dict[str, Any] = {
        "torch_adamw_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
        "torch_adamw_fused": lambda ps: torch.optim.AdamW(ps, fused=True),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.optim import AdamW8bit
            from torchao.optim import AdamWFp8 as TorchaoAdamWFp8
        out["torchao_adamw_fp8"] = lambda ps: TorchaoAdamWFp8(ps)
        out["torchao_adamw_8bit"] = lambda ps: AdamW8bit(ps)
    except Exception as exc:  # torchao missing or broken: report, do not fail
        out["torchao_adamw_fp8"] = out["torchao_adamw_8bit"] = f"torchao unavailable: {exc!r}"
    out["adamw_fp8_coat"] = lambda ps: AdamWFp8(ps, dynamic_range_expansion=True)
    out["adamw_fp8"] = lambda ps: AdamWFp8(ps, dynamic_range_expansion=False)
    for name, options in OPTION_VARIANTS.items():
        out[name] = lambda ps, options=options: AdamWFp8(ps, **options)
    return out


def make_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in SHAPES.values():
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        p.grad = torch.randn(shape, generator=g) * 1e-3 * torch.rand(shape, generator=g)
        params.append(p)
    return params


def bench(
    rounds: int, steps_per_round: int, only: list[str] | None = None, sweep_rounds: int = 12
) -> dict[str, Any]:
    opts: dict[str, torch.optim.Optimizer] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name, factory in candidates().items():
        if only and name not in only and name not in ("torch_adamw_foreach", "torch_adamw_fused"):
            continue
        if isinstance(factory, str):
            rows[name] = {"skipped": factory}
            continue
        params = make_params()
        opt = factory(params)
        start = time.perf_counter()
        try:
            opt.step()
        except Exception as exc:  # e.g. torch.compile unusable for torchao on this machine
            rows[name] = {"skipped": f"first step failed: {exc!r}"}
            continue
        rows[name] = {"first_step_s": round(time.perf_counter() - start, 3), "times_ms": []}
        opts[name] = opt
        total, numel = state_bytes(opt)
        rows[name]["bytes_per_param"] = round(total / numel, 4)
        if isinstance(opt, AdamWFp8):
            q_total, q_numel = state_bytes(opt, quantized_only=True)
            rows[name]["bytes_per_param_quantized"] = round(q_total / q_numel, 4)
        print(f"{name}: first step {rows[name]['first_step_s']} s", flush=True)
    for _ in range(rounds):
        for name, opt in opts.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                opt.step()
            rows[name]["times_ms"].append((time.perf_counter() - start) * 1e3 / steps_per_round)
    for name in opts:
        times = rows[name].pop("times_ms")
        rows[name]["step_ms_best"] = round(min(times), 2)
        rows[name]["step_ms_median"] = round(statistics.median(times), 2)
    single_thread_cpu(opts, rows, rounds=max(2, rounds // 3))
    if "torch_adamw_fused" in opts:
        rows["_thread_sweep"] = thread_sweep(opts, rounds=sweep_rounds)
    return rows


def single_thread_cpu(opts: dict[str, torch.optim.Optimizer], rows: dict, rounds: int) -> None:
    """CPU time of one step on one thread: robust to other processes sharing the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in opts:
            if name.startswith("torch_adamw") or isinstance(opts[name], AdamWFp8):
                opts[name].step()
                times = []
                for _ in range(rounds):
                    start = time.thread_time()
                    opts[name].step()
                    times.append((time.thread_time() - start) * 1e3)
                rows[name]["single_thread_cpu_ms"] = round(min(times), 2)
    finally:
        torch.set_num_threads(threads)
    base = rows["torch_adamw_foreach"]["single_thread_cpu_ms"]
    for name in rows:
        if "single_thread_cpu_ms" in rows[name]:
            rows[name]["single_thread_ratio_vs_adamw_foreach"] = round(
                rows[name]["single_thread_cpu_ms"] / base, 3
            )


def _machine_busy_ticks() -> int | None:
    """CPU ticks all processes spent busy so far (Linux ``/proc/stat``), else ``None``."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(values) - values[3] - values[4]  # minus idle and iowait


def _own_ticks() -> float:
    t = os.times()
    return (t.user + t.system) * os.sysconf("SC_CLK_TCK")


def thread_sweep(
    opts: dict[str, torch.optim.Optimizer], rounds: int, threads: tuple[int, ...] = (1, 2)
) -> dict[str, dict[str, float]]:
    """Best wall time of one step of torch fused AdamW and of each AdamWFp8 at each thread
    count, interleaved round by round; ratios against fused AdamW at the same count.

    A round counts as quiet when other processes used < 5 % of the machine's CPU time during it
    (``/proc/stat`` minus this process); the best times come from the quiet rounds when there
    are at least 3 (``quiet_rounds`` says how many), so that a second thread sharing its core
    with another process does not decide the 2-thread ratio."""
    names = [n for n in opts if n == "torch_adamw_fused" or isinstance(opts[n], AdamWFp8)]
    saved = torch.get_num_threads()
    hz, cpus = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    out: dict[str, dict[str, float]] = {}
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            times: dict[str, list[float]] = {n: [] for n in names}
            quiet: list[bool] = []
            for name in names:
                opts[name].step()  # warm up at this thread count
            for _ in range(rounds):
                busy0, own0, wall0 = _machine_busy_ticks(), _own_ticks(), time.perf_counter()
                for name in names:
                    start = time.perf_counter()
                    opts[name].step()
                    times[name].append((time.perf_counter() - start) * 1e3)
                busy1 = _machine_busy_ticks()
                if busy0 is None or busy1 is None:
                    quiet.append(True)
                    continue
                other = (busy1 - busy0) - (_own_ticks() - own0)
                quiet.append(other <= 0.05 * (time.perf_counter() - wall0) * hz * cpus)
            use = quiet if sum(quiet) >= 3 else [True] * len(quiet)
            best = {n: min(t for t, q in zip(times[n], use, strict=True) if q) for n in names}
            fused = best["torch_adamw_fused"]
            out[f"{n_threads}_threads"] = {
                "quiet_rounds": sum(quiet),
                "rounds": len(quiet),
                **{f"{n}_ms": round(t, 2) for n, t in best.items()},
                **{f"{n}_vs_fused": round(t / fused, 3) for n, t in best.items()},
            }
    finally:
        torch.set_num_threads(saved)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    """Bar charts: best step time and state bytes per parameter of each optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in results["optimizers"].items() if "step_ms_best" in v}
    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.barh(names, [rows[n]["step_ms_best"] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax1.text(
            rows[n]["step_ms_best"], i, f" {rows[n]['ratio_vs_adamw_foreach']:.2f}x", va="center"
        )
    ax1.set(xlabel="step time, ms (best round)", title=f"{results['parameters'] / 1e6:.1f}M params")
    ax2.barh(names, [rows[n]["bytes_per_param"] for n in names], color="tab:green")
    ax2.set(xlabel="optimizer state bytes / parameter")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return the results dict (also written as JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--output", type=Path, help="JSON path (default benchmarks/results/)")
    parser.add_argument(
        "--warm-cache", action="store_true", help="reuse the C kernel cache (default: cold start)"
    )
    parser.add_argument("--only", nargs="+", help="optimizer names to time (foreach always runs)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--sweep-rounds",
        type=int,
        help="rounds of the 1 / 2-thread sweep against fused AdamW (default 12, --quick 3)",
    )
    args = parser.parse_args(argv)
    rounds, steps_per_round = (3, 1) if args.quick else (9, 2)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        previous = os.environ.get("HF_FP8_CACHE")
        if not args.warm_cache:
            os.environ["HF_FP8_CACHE"] = cache
        try:
            sweep_rounds = args.sweep_rounds or (3 if args.quick else 12)
            rows = bench(rounds, steps_per_round, args.only, sweep_rounds)
        finally:
            if previous is None:
                os.environ.pop("HF_FP8_CACHE", None)
            else:
                os.environ["HF_FP8_CACHE"] = previous
    sweep = rows.pop("_thread_sweep", {})
    base = rows["torch_adamw_foreach"]["step_ms_best"]
    for row in rows.values():
        if "step_ms_best" in row:
            row["ratio_vs_adamw_foreach"] = round(row["step_ms_best"] / base, 3)
    coat = rows.get("adamw_fp8_coat", {})
    if "step_ms_best" not in coat:
        print(json.dumps(rows, indent=2))
        return {"optimizers": rows}
    summary: dict[str, Any] = {
        "coat_step_vs_adamw_foreach": coat["ratio_vs_adamw_foreach"],
        "coat_single_thread_cpu_vs_adamw_foreach": coat.get("single_thread_ratio_vs_adamw_foreach"),
        "coat_first_step_s": coat["first_step_s"],
        "bytes_per_param_quantized": coat["bytes_per_param_quantized"],
        "bytes_per_param_quantized_by_option": {
            n: r["bytes_per_param_quantized"]
            for n, r in rows.items()
            if "bytes_per_param_quantized" in r
        },
        "coat_vs_fused_adamw": {k: v.get("adamw_fp8_coat_vs_fused") for k, v in sweep.items()},
        "vs_fused_adamw_by_option": sweep,
    }
    met = {
        "coat_vs_fused_adamw_max": bool(sweep)
        and all(
            (v.get("adamw_fp8_coat_vs_fused") or 99) <= TARGETS["coat_vs_fused_adamw_max"]
            for v in sweep.values()
        ),
        "coat_step_vs_adamw_foreach_max": summary["coat_step_vs_adamw_foreach"]
        <= TARGETS["coat_step_vs_adamw_foreach_max"],
        "coat_first_step_s_max": coat["first_step_s"] <= TARGETS["coat_first_step_s_max"],
        "bytes_per_param_quantized_max": coat["bytes_per_param_quantized"]
        <= TARGETS["bytes_per_param_quantized_max"],
    }
    if "step_ms_best" in rows.get("torchao_adamw_fp8", {}):
        speedup = rows["torchao_adamw_fp8"]["step_ms_best"] / coat["step_ms_best"]
        summary["coat_speedup_vs_torchao_fp8"] = round(speedup, 2)
        met["coat_speedup_vs_torchao_fp8_min"] = (
            speedup >= TARGETS["coat_speedup_vs_torchao_fp8_min"]
        )
    results = {
        "device": f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "kernel_threads": "torch's OpenMP pool"
        if _cpu_kernel.shares_torch_openmp()
        else "POSIX threads",
        "quick": args.quick,
        "parameters": sum(torch.Size(s).numel() for s in SHAPES.values()),
        "shapes": {k: list(v) for k, v in SHAPES.items()},
        "timing": f"best / median of {rounds} interleaved rounds of {steps_per_round} steps",
        "targets": TARGETS,
        "optimizers": rows,
        "summary": summary,
        "targets_met": met,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps({"optimizers": rows, "summary": summary, "targets_met": met}, indent=2))
    output = args.output or RESULTS / ("optim_quick.json" if args.quick else "optim.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    if not args.no_plot:
        plot(results, output.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
