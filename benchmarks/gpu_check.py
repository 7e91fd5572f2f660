"""One self-contained CUDA check (H100/H200 class), under 8 minutes.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu.json] [--budget-s 420] [--cpu-smoke]

1. ``torch._scaled_mm`` parity with the emulated path for each scheme and granularity
   (the kernel ``auto`` picked is reported: block scales and weight-only stay emulated);
2. ``Fp8Linear`` vs bf16 ``nn.Linear`` speed, eager and compiled, M ∈ {16, 512, 4096, 16384}
   on Llama-3-8B MLP shapes (K=4096, N=14336 and back);
3. a compiled Llama-shaped MLP block (gate/up/down + SiLU), FP8 vs bf16;
4. ``AdamWFp8`` step time and state bytes vs ``torch.optim.AdamW(fused=True)`` on ~1B
   parameters (60 matrices of 4096 × 4096: 1-D tensors would keep fp32 states);
5. optional: weight-only at M = 16 through the fused GEMV the CPU path uses for M ≤ 4
   (a candidate for CUDA; the default CUDA weight-only path decodes the weight, then bf16
   matmul).

Compilations dominate the run time (about 14, each 5–60 s): compiled linears use
``dynamic=True`` (one graph per layer and recipe for every M), weight-only is measured
eager only, and the optional rows (static MLP, plain AdamWFp8) run last, only while the
``--budget-s`` time budget lasts. Prints one markdown table and writes JSON (with the
seconds each section took). ``--cpu-smoke`` runs every code path on tiny shapes on the CPU
(the test suite uses it; no timing meaning).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import hf_fp8
from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.kernels import has_fp8_gemm, unsupported_reason

SCHEMES = [
    ("dynamic", "row"),
    ("dynamic", "tensor"),
    ("dynamic", "block"),
    ("static", "tensor"),
    ("static", "row"),
    ("weight_only", "row"),
]
SPEED_RECIPES = [("dynamic", "row"), ("static", "tensor"), ("weight_only", "row")]
COMPILED_SPEED = ("bf16", "dynamic/row", "static/tensor")  # weight-only: eager only
_ACT_GRAN = {"tensor": "tensor", "token": "row", "block": "block"}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, iters: int) -> float:
    """Milliseconds per call after 3 warm-up calls (which include any compilation)."""
    for _ in range(3):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _fp8(linear: nn.Linear, scheme: str, granularity: str, kernel: str) -> Fp8Linear:
    config = Fp8Config(
        scheme,
        weight_granularity=granularity,
        kernel=kernel,
        activation_scale=0.05 if scheme == "static" else None,
    )
    return Fp8Linear.from_linear(linear, config)


def _auto_kernel(module: Fp8Linear, x: torch.Tensor) -> str:
    """The kernel ``kernel='auto'`` runs for this layer and input."""
    if module.activation_scheme == "weight_only":
        return "emulated"
    dtype, a_gran = module.weight.dtype, _ACT_GRAN[module.activation_granularity]
    reason = unsupported_reason(x.device, x.dtype, dtype, dtype, a_gran, module.weight_granularity)
    return "scaled_mm" if reason is None else "emulated"


def reference(module: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """Float64 ``fake_quant(x) @ W.T + bias`` written here from the layer's stored tensors,
    independent of hf_fp8's kernels and numerics: the fp8 weight through torch's cast times
    its expanded scale; the activation quantized in a few lines (amax / fp8_max per token,
    tensor or 1 x bk block, floored at the smallest normal fp32; saturating cast)."""
    w = module.weight.to(torch.float64)
    n, k = w.shape
    bn, bk = module.block_size
    s = module.weight_scale.to(torch.float64)
    if module.weight_granularity == "block":
        s = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    w = w * s.reshape(-1, 1) if s.dim() < 2 or s.shape[-1] == 1 else w * s
    a = x.to(torch.float64)
    if module.activation_scheme != "weight_only":
        fp8 = module.weight.dtype
        fmax = torch.finfo(fp8).max
        if module.activation_scheme == "static":
            scale = module.input_scale.to(torch.float64).reshape(1, 1)
        else:
            mag = a.abs()
            gran = module.activation_granularity
            if gran == "tensor":
                amax = mag.max().reshape(1, 1)
            elif gran == "token":
                amax = mag.amax(-1, keepdim=True)
            else:  # 1 x bk blocks along K
                pad = torch.nn.functional.pad(mag, (0, -k % bk))
                amax = pad.reshape(a.shape[0], -1, bk).amax(-1)
                amax = amax.repeat_interleave(bk, 1)[:, :k]
            scale = (amax / fmax).clamp(min=torch.finfo(torch.float32).tiny)
        q = (a / scale).clamp(-fmax, fmax).to(torch.float32).to(fp8).to(torch.float64)
        a = q * scale
    out = a @ w.T
    return out if module.bias is None else out + module.bias.to(torch.float64)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def parity(device, k: int, n: int, m: int) -> list[dict]:
    """``auto`` against the emulated kernel, and both against an independent float64
    reference (:func:`reference`). Eager emulation bodies (HF_FP8_COMPILE=0)."""
    rows = []
    linear = nn.Linear(k, n, bias=True, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with _env("HF_FP8_COMPILE", "0"), torch.no_grad():
        for scheme, granularity in SCHEMES:
            emulated = _fp8(linear, scheme, granularity, "emulated")
            auto = _fp8(linear, scheme, granularity, "auto")
            a, b = auto(x).float(), emulated(x).float()
            ref = reference(auto, x)
            rows.append(
                {
                    "check": "parity",
                    "scheme": scheme,
                    "granularity": granularity,
                    "kernel": _auto_kernel(auto, x),
                    "max_rel_diff": float((a - b).abs().max() / b.abs().max()),
                    "auto_rel_err_vs_reference": _rel(a, ref),
                    "emulated_rel_err_vs_reference": _rel(b, ref),
                }
            )
    return rows


def linear_speed(device, shapes, ms, iters: int) -> list[dict]:
    rows = []
    for k, n in shapes:
        linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        variants: dict[str, nn.Module] = {"bf16": linear}
        for scheme, granularity in SPEED_RECIPES:
            variants[f"{scheme}/{granularity}"] = _fp8(linear, scheme, granularity, "auto")
        xs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in ms}
        times: dict[tuple[str, int, str], float] = {}
        breaks: dict[str, int] = {}
        with torch.no_grad():
            for name, module in variants.items():
                for m in ms:
                    times["eager", m, name] = _time(lambda f=module, x=xs[m]: f(x), device, iters)
            for name in COMPILED_SPEED:  # one graph for every M
                before = _graph_breaks()
                fn = torch.compile(variants[name], dynamic=True)
                for m in ms:
                    times["compiled", m, name] = _time(lambda f=fn, x=xs[m]: f(x), device, iters)
                breaks[name] = _graph_breaks() - before
        for (mode, m, name), ms_ in times.items():
            row = {"check": "linear", "M": m, "K": k, "N": n, "mode": mode, "variant": name}
            row.update(ms=ms_, speedup_vs_bf16=times[mode, m, "bf16"] / ms_)
            if mode == "compiled":
                row["graph_breaks"] = breaks[name]
            rows.append(row)
    return rows


def weight_only_gemv(device, shapes, m: int, iters: int) -> list[dict]:
    """Candidate for weight-only at small M: the CPU's fused GEMV (each fp8 weight element
    read once for all ``m`` tokens, compiled by inductor), against bf16 and the default
    weight-only path. Informs whether the GEMV path should also serve CUDA; not used there yet.
    """
    from hf_fp8.kernels import compiled
    from hf_fp8.kernels.emulated import _gemv

    rows = []
    for k, n in shapes:
        linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        module = _fp8(linear, "weight_only", "row", "auto")
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

        def gemv(x=x, module=module):
            return compiled.run(
                _gemv, x.float(), module.weight, None, module.weight_scale, None,
                tokens=m, out_dtype=x.dtype,
            )  # fmt: skip

        with torch.no_grad():
            ref = module(x).float()
            diff = float((gemv().float() - ref).abs().max() / ref.abs().max())
            bf16_ms = _time(lambda f=linear, x=x: f(x), device, iters)
            ms_ = _time(gemv, device, iters)
        rows.append(
            {
                "check": "linear",
                "M": m,
                "K": k,
                "N": n,
                "mode": "compiled",
                "variant": "weight_only/row fused GEMV (candidate)",
                "ms": ms_,
                "speedup_vs_bf16": bf16_ms / ms_,
                "max_rel_diff": diff,
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


MLP_RECIPES = {
    "bf16": None,
    "dynamic/row": lambda: Fp8Config("dynamic"),
    "static/tensor": lambda: Fp8Config("static", activation_scale=0.05),
}


def mlp_block(device, hidden: int, inter: int, m: int, iters: int, names, bf16_ms=None):
    """Rows for the compiled MLP ``names`` and the bf16 time they are compared with."""
    torch.manual_seed(1)
    x = torch.randn(m, hidden, device=device, dtype=torch.bfloat16)
    times = {}
    for name in names:
        model = _Mlp(hidden, inter, device)
        if MLP_RECIPES[name] is not None:
            model = hf_fp8.quantize_model(model, MLP_RECIPES[name]())
        before = _graph_breaks()
        fn = torch.compile(model)
        with torch.no_grad():
            times[name] = (_time(lambda f=fn: f(x), device, iters), _graph_breaks() - before)
        del model, fn
    bf16_ms = times["bf16"][0] if "bf16" in times else bf16_ms
    rows = [
        {
            "check": "mlp_block",
            "M": m,
            "variant": name,
            "mode": "compiled",
            "ms": ms_,
            "speedup_vs_bf16": bf16_ms / ms_,
            "graph_breaks": gb,
        }
        for name, (ms_, gb) in times.items()
    ]
    return rows, bf16_ms


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def optimizer_step(device, shape, count: int, iters: int, names, fused_ms=None):
    """Step time and state bytes per parameter on ``count`` fp32 matrices of ``shape``."""
    from hf_fp8.optim import AdamWFp8

    numel = count * shape[0] * shape[1]
    rows = []
    for name in names:
        params = [nn.Parameter(torch.randn(shape, device=device) * 0.02) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        if name == "AdamW fused":
            opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        else:
            opt = AdamWFp8(params, lr=1e-4, dynamic_range_expansion=name.endswith("coat"))
        ms_ = _time(opt.step, device, iters)
        fused_ms = ms_ if name == "AdamW fused" else fused_ms
        rows.append(
            {
                "check": "optimizer",
                "params": numel,
                "variant": name,
                "ms": ms_,
                "speedup_vs_fused": fused_ms / ms_,
                "state_bytes_per_param": _state_bytes(opt) / numel,
            }
        )
        del opt, params, p
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, fused_ms


def _print_table(info: dict) -> None:
    print(f"\n{info['device']}, torch {info['torch']}, {info['seconds']:.0f} s\n")
    print("| check | shape / setting | variant | ms | ratio | max rel diff |")
    print("|---|---|---|---|---|---|")
    for r in info["rows"]:
        check = r["check"]
        if "skipped" in r:
            shape = "skipped: time budget"
        elif check == "linear":
            shape = f"M={r['M']} K={r['K']} N={r['N']} {r['mode']}"
        elif check == "mlp_block":
            shape = f"M={r['M']} compiled"
        elif check == "optimizer":
            shape = f"{r['params'] / 1e9:.2f}B params"
        else:
            shape = ""
        if r.get("graph_breaks"):
            shape += f" ({r['graph_breaks']} graph breaks)"
        if check == "parity":
            variant = f"{r['scheme']}/{r['granularity']} ({r['kernel']})"
        else:
            variant = r["variant"]
        if "state_bytes_per_param" in r:
            variant += f", {r['state_bytes_per_param']:.2f} B/param state"
        ratio = r.get("speedup_vs_bf16", r.get("speedup_vs_fused"))
        ratio = f"{ratio:.2f}x" if ratio is not None else ""
        ms_ = f"{r['ms']:.3f}" if "ms" in r else ""
        diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else ""
        print(f"| {check} | {shape} | {variant} | {ms_} | {ratio} | {diff} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu.json"))
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="optional rows run only within this time"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.cpu_smoke:
        device = torch.device("cpu")
        shapes, ms, iters, hidden, inter, m_mlp = [(64, 96)], [8], 1, 64, 96, 8
        opt_shape, opt_count = (64, 160), 1
    else:
        if not has_fp8_gemm():
            raise SystemExit("gpu_check.py needs a CUDA GPU with compute capability >= 8.9")
        device = torch.device("cuda")
        shapes, ms, iters = [(4096, 14336), (14336, 4096)], [16, 512, 4096, 16384], 20
        hidden, inter, m_mlp = 4096, 14336, 4096
        opt_shape, opt_count = (4096, 4096), 60  # 1.007e9 parameters, one compiled shape
    # Fp8Linear.forward is one code object for every layer and recipe: keep dynamo from
    # falling back to eager (silently) after its default 8 cache entries.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    torch.manual_seed(0)
    sections: dict[str, float] = {}

    def timed(name, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        sections[name] = round(time.perf_counter() - t0, 1)
        return out

    def time_left(reserve_s: float) -> bool:
        return args.cpu_smoke or time.perf_counter() - start + reserve_s < args.budget_s

    k, n = shapes[0]
    rows = timed("parity", parity, device, k, n, 4 if args.cpu_smoke else 512)
    rows += timed("linear", linear_speed, device, shapes, ms, iters)
    mlp_rows, bf16_ms = timed(
        "mlp_block", mlp_block, device, hidden, inter, m_mlp, iters, ["bf16", "dynamic/row"]
    )
    opt_iters = max(iters // 4, 1)
    opt_rows, fused_ms = timed(
        "optimizer",
        optimizer_step,
        device,
        opt_shape,
        opt_count,
        opt_iters,
        ["AdamW fused", "AdamWFp8 coat"],
    )

    # optional rows, while the budget lasts (each is about one compilation)
    def optional(section: str, reserve_s: float, row: dict, fn, *fn_args) -> list[dict]:
        """Rows of ``fn(*fn_args)`` while the time budget lasts, else ``row`` marked skipped."""
        if not time_left(reserve_s):
            return [{**row, "skipped": "budget"}]
        out = timed(section, fn, *fn_args)
        return out[0] if isinstance(out, tuple) else out

    mlp = [device, hidden, inter, m_mlp, iters, ["static/tensor"], bf16_ms]
    mlp_rows += optional(
        "mlp_block_static", 60, {"check": "mlp_block", "variant": "static/tensor"}, mlp_block, *mlp
    )
    opt = [device, opt_shape, opt_count, opt_iters, ["AdamWFp8 plain"], fused_ms]
    opt_rows += optional(
        "optimizer_plain", 60, {"check": "optimizer", "variant": "AdamWFp8 plain"},
        optimizer_step, *opt,
    )  # fmt: skip
    rows += mlp_rows + opt_rows
    rows += optional(
        "weight_only_gemv", 45, {"check": "linear", "variant": "weight_only fused GEMV"},
        weight_only_gemv, device, shapes, ms[0], iters,
    )  # fmt: skip
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "sections": sections,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=2))
    _print_table(info)
    return info


if __name__ == "__main__":
    main()
