"""Time of a Qwen3-MoE-shaped sparse experts block: ``Fp8Experts`` against bf16 experts.

The bf16 baseline is transformers' own ``Qwen3MoeExperts`` with its default experts
implementation (``grouped_mm``: ``torch._grouped_mm`` on the CPU), in the same run. The
router is not timed (both sides get the same top-k ids and weights). Candidates are timed
interleaved, round by round, and the best round is kept (robust to other processes).

    python benchmarks/bench_moe_block.py                 # 64 experts, top-8, H 2048, I 768
    python benchmarks/bench_moe_block.py --quick          # fewer rounds
    python benchmarks/bench_moe_block.py --experts 16     # a smaller block
    python benchmarks/bench_moe_block.py --threads 1 2    # the default: 1, then 2 threads
    python benchmarks/bench_moe_block.py --rounds 15      # more rounds on a busy machine

One thread is timed by its own CPU time (``--clock thread``, the default: stable on a shared
machine); more threads by the wall clock (``--clock wall`` times one thread by the wall clock
too). Writes ``benchmarks/results/moe_block.json`` (``--output``): seconds per call for 1 token
(decode) and 512 tokens (prefill) per thread count, the ratio to bf16 in the same round-robin,
the load average before and after, and bytes per expert parameter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from hf_fp8 import Fp8Config  # noqa: E402
from hf_fp8.modules.fp8_experts import Fp8Experts, bytes_per_parameter  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def build(experts: int, hidden: int, inter: int, top_k: int) -> Qwen3MoeExperts:
    config = Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
    )
    config._experts_implementation = "grouped_mm"  # transformers' default
    with torch.device("meta"):
        module = Qwen3MoeExperts(config)
    module.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return module.to(torch.bfloat16)


def routing(tokens: int, hidden: int, experts: int, top_k: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, index, weights.to(torch.bfloat16)


def best_times(
    candidates: dict, inputs: tuple, rounds: int, calls: int, clock=time.perf_counter
) -> dict[str, float]:
    best = dict.fromkeys(candidates, float("inf"))
    with torch.inference_mode():
        for module in candidates.values():  # warm up (compilation, caches)
            module(*inputs)
            module(*inputs)
        for _ in range(rounds):
            for name, module in candidates.items():
                start = clock()
                for _ in range(calls):
                    module(*inputs)
                best[name] = min(best[name], (clock() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--schemes", nargs="+", default=["weight_only", "dynamic"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=0, help="round-robin rounds (default 7, --quick 3)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="thread",
        help="thread (default): a one-thread run is timed by its own CPU time (stable on a "
        "shared machine); wall: by the wall clock. Runs on more threads use the wall clock.",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "moe_block.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()

    bf16 = build(args.experts, args.hidden, args.intermediate, args.top_k)
    candidates = {"bf16 grouped_mm": bf16}
    bytes_pp = {}
    for scheme in args.schemes:
        start = time.perf_counter()
        fp8 = Fp8Experts.from_experts(bf16, Fp8Config(scheme))
        print(f"quantized {scheme} in {time.perf_counter() - start:.1f} s", flush=True)
        candidates[f"fp8 {scheme}"] = fp8
        bytes_pp[scheme] = bytes_per_parameter(fp8)

    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock_name = "thread" if args.clock == "thread" and threads == 1 else "wall"
        clock = time.thread_time if clock_name == "thread" else time.perf_counter
        for tokens in args.tokens:
            inputs = routing(tokens, args.hidden, args.experts, args.top_k)
            rounds = args.rounds or (3 if args.quick else 7)
            calls = max(1, (20 if tokens == 1 else 2) // (2 if args.quick else 1))
            best = best_times(candidates, inputs, rounds, calls, clock)
            base = best["bf16 grouped_mm"]
            for name, seconds in best.items():
                rows.append(
                    {
                        "threads": threads,
                        "clock": clock_name,
                        "tokens": tokens,
                        "candidate": name,
                        "seconds": seconds,
                        "ratio": seconds / base,
                    }
                )
                print(
                    f"threads={threads} ({clock_name:6s}) tokens={tokens:4d}  {name:18s} "
                    f"{seconds * 1e3:9.2f} ms  {seconds / base:5.2f}x",
                    flush=True,
                )

    result = {
        "block": {
            "experts": args.experts,
            "top_k": args.top_k,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "clock": args.clock,
            "load_average_before": [round(v, 2) for v in load_before],
            "load_average_after": [round(v, 2) for v in os.getloadavg()],
            "torch": torch.__version__,
        },
        "rounds": args.rounds or (3 if args.quick else 7),
        "bytes_per_expert_parameter": bytes_pp,
        "rows": rows,
        "targets": {"prefill_ratio_max": 1.3, "decode_ratio_max": 1.5, "bytes_per_param_max": 1.01},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
