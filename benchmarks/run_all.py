"""Run every benchmark in one process (``make bench``); results in benchmarks/results/.

    python benchmarks/run_all.py [--quick] [--only linear,minilm]

Each benchmark measures its own baseline in the same run and writes its JSON (and plots);
this script adds summary.json with wall times.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = [
    "bench_linear",
    "bench_generate",
    "bench_optim",
    "bench_optim_fidelity",
    "bench_minilm",
    "bench_checkpoint",
    "bench_moe_block",
    "bench_moe_coverage",
    "bench_moe_accuracy",
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument("--only", default="", help="comma-separated names, e.g. linear,minilm")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    chosen = [
        b for b in BENCHMARKS if not args.only or b.removeprefix("bench_") in args.only.split(",")
    ]
    summary = {}
    for name in chosen:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        importlib.import_module(name).main(["--quick"] if args.quick else [])
        summary[name] = {"seconds": round(time.perf_counter() - start, 1)}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n| benchmark | wall time (s) |\n|---|---|")
    for name, row in summary.items():
        print(f"| {name} | {row['seconds']} |")
    print(f"| total | {sum(r['seconds'] for r in summary.values()):.1f} |")
    return summary


if __name__ == "__main__":
    main()
