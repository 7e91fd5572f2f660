"""One self-contained CUDA check (H100/H200 class), under 8 minutes.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu.json] [--cpu-smoke]

1. ``torch._scaled_mm`` parity with the emulated path for each scheme and granularity;
2. ``Fp8Linear`` vs bf16 ``nn.Linear`` speed, eager and compiled, M ∈ {16, 512, 4096, 16384}
   on Llama-3-8B MLP shapes (K=4096, N=14336 and back);
3. a compiled Llama-shaped MLP block (gate/up/down + SiLU), FP8 vs bf16;
4. ``AdamWFp8`` step time vs ``torch.optim.AdamW(fused=True)`` on 1B parameters.

Prints one markdown table and writes JSON. ``--cpu-smoke`` runs every code path on tiny
shapes on the CPU (the test suite uses it; no timing meaning).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.kernels import has_fp8_gemm

SCHEMES = [
    ("dynamic", "row"),
    ("dynamic", "tensor"),
    ("dynamic", "block"),
    ("static", "tensor"),
    ("static", "row"),
    ("weight_only", "row"),
]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, iters: int) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def _fp8(linear: nn.Linear, scheme: str, granularity: str, kernel: str) -> Fp8Linear:
    config = Fp8Config(
        scheme,
        weight_granularity=granularity,
        kernel=kernel,
        activation_scale=0.05 if scheme == "static" else None,
    )
    return Fp8Linear.from_linear(linear, config)


def parity(device, k: int, n: int, m: int) -> list[dict]:
    rows = []
    linear = nn.Linear(k, n, bias=True, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    for scheme, granularity in SCHEMES:
        emulated = _fp8(linear, scheme, granularity, "emulated")
        auto = _fp8(linear, scheme, granularity, "auto")
        with torch.no_grad():
            a, b = auto(x).float(), emulated(x).float()
        rows.append(
            {
                "check": "parity",
                "scheme": scheme,
                "granularity": granularity,
                "max_rel_diff": float((a - b).abs().max() / b.abs().max()),
            }
        )
    return rows


def linear_speed(device, shapes, ms, iters: int, compile_: bool) -> list[dict]:
    rows = []
    for k, n in shapes:
        linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        variants = {"bf16": linear}
        for scheme in ("dynamic", "static", "weight_only"):
            granularity = "tensor" if scheme == "static" else "row"
            variants[f"{scheme}/{granularity}"] = _fp8(linear, scheme, granularity, "auto")
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            for mode in ("eager", "compiled") if compile_ else ("eager",):
                times = {}
                for name, module in variants.items():
                    fn = torch.compile(module) if mode == "compiled" else module
                    with torch.no_grad():
                        times[name] = _time(lambda f=fn, x=x: f(x), device, iters)
                for name, ms_ in times.items():
                    rows.append(
                        {
                            "check": "linear",
                            "M": m,
                            "K": k,
                            "N": n,
                            "mode": mode,
                            "variant": name,
                            "ms": ms_,
                            "speedup_vs_bf16": times["bf16"] / ms_,
                        }
                    )
    return rows


class _Mlp(nn.Module):
    def __init__(self, hidden: int, inter: int, device) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=torch.bfloat16)
        self.gate, self.up = nn.Linear(hidden, inter, **kw), nn.Linear(hidden, inter, **kw)
        self.down = nn.Linear(inter, hidden, **kw)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def mlp_block(device, hidden: int, inter: int, m: int, iters: int) -> list[dict]:
    rows = []
    x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
    base = _Mlp(hidden, inter, device)
    times = {}
    for name, config in (
        ("bf16", None),
        ("dynamic/row", Fp8Config("dynamic")),
        ("static/tensor", Fp8Config("static", activation_scale=0.05)),
    ):
        model = (
            base
            if config is None
            else hf_fp8.quantize_model(_copy(base, hidden, inter, device), config)
        )
        fn = torch.compile(model)
        with torch.no_grad():
            times[name] = _time(lambda f=fn, x=x: f(x), device, iters)
    for name, ms_ in times.items():
        rows.append(
            {
                "check": "mlp_block",
                "M": m,
                "variant": name,
                "ms": ms_,
                "speedup_vs_bf16": times["bf16"] / ms_,
            }
        )
    return rows


def _copy(base: _Mlp, hidden: int, inter: int, device) -> _Mlp:
    clone = _Mlp(hidden, inter, device)
    clone.load_state_dict(base.state_dict())
    return clone


def optimizer_step(device, numel: int, iters: int) -> list[dict]:
    from hf_fp8.optim import AdamWFp8

    rows, times = [], {}
    chunk = 4096 * 4096
    sizes = [chunk] * (numel // chunk) + ([numel % chunk] if numel % chunk else [])
    for name in ("AdamW fused", "AdamWFp8 coat", "AdamWFp8 plain"):
        params = [nn.Parameter(torch.randn(s, device=device) * 0.02) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        if name == "AdamW fused":
            opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        else:
            opt = AdamWFp8(params, lr=1e-4, dynamic_range_expansion=name.endswith("coat"))
        times[name] = _time(opt.step, device, iters)
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, ms_ in times.items():
        rows.append(
            {
                "check": "optimizer",
                "params": numel,
                "variant": name,
                "ms": ms_,
                "speedup_vs_fused": times["AdamW fused"] / ms_,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu.json"))
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        shapes, ms, iters, hidden, inter, numel = [(64, 96)], [4], 1, 64, 96, 10_000
    else:
        if not has_fp8_gemm():
            raise SystemExit("gpu_check.py needs a CUDA GPU with compute capability >= 8.9")
        device = torch.device("cuda")
        shapes, ms, iters = [(4096, 14336), (14336, 4096)], [16, 512, 4096, 16384], 20
        hidden, inter, numel = 4096, 14336, 1_000_000_000
    torch.manual_seed(0)
    rows = parity(device, shapes[0][0], shapes[0][1], 512 if not args.cpu_smoke else 4)
    rows += linear_speed(device, shapes, ms, iters, compile_=True)
    rows += mlp_block(device, hidden, inter, 4096 if not args.cpu_smoke else 4, iters)
    rows += optimizer_step(device, numel, max(iters // 4, 1))
    info = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=2))
    print(f"\n{info['device']}, torch {info['torch']}\n")
    print(
        "| check | shape / setting | variant | ms | ratio | max rel diff |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        shape = (
            f"M={r['M']} K={r['K']} N={r['N']} {r['mode']}"
            if r["check"] == "linear"
            else f"M={r.get('M', '')}"
            if r["check"] == "mlp_block"
            else f"{r.get('params', '')} params"
            if r["check"] == "optimizer"
            else ""
        )
        variant = r.get("variant") or f"{r['scheme']}/{r['granularity']}"
        ratio = r.get("speedup_vs_bf16", r.get("speedup_vs_fused", ""))
        ratio = f"{ratio:.2f}x" if ratio != "" else ""
        ms_ = f"{r['ms']:.3f}" if "ms" in r else ""
        diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else ""
        print(f"| {r['check']} | {shape} | {variant} | {ms_} | {ratio} | {diff} |")
    return info


if __name__ == "__main__":
    main()
