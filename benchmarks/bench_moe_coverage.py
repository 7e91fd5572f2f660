"""FP8 coverage over every causal-LM family of the installed transformers (dense and MoE).

    python benchmarks/bench_moe_coverage.py [--quick] [--families qwen3_moe,mixtral]

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that builds tiny on the CPU
(its default config, sizes shrunk): save it (fp32), load it with
``Fp8Config("dynamic")`` through ``from_pretrained`` (the quantizer swaps linears and
experts), and measure

* ``fp8_share``: parameters stored as fp8 codes / non-embedding parameters (the input
  embeddings and the output head are left out of both, as the issue counts);
* ``rel_error``: ``||logits_fp8 - logits_fp32|| / ||logits_fp32||`` on one fixed batch;
* ``reload_identical``: ``save_pretrained`` then ``from_pretrained`` gives the same tensors
  (bits) and the same logits;
* ``high_precision`` / ``full_size_high_precision``: the largest parts left in high
  precision (tiny model as loaded / default config on meta), their share and why
  (``hf_fp8.modules.selection.high_precision_parts``: the keep rules' words).

Families that do not build, load or run tiny are listed with the error. Writes
``benchmarks/results/moe_coverage.json`` and ``moe_coverage.png``. Target: fp8_share >= 0.99.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_FP8_COMPILE", "0")

import torch
import transformers as tf
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_fp8 import Fp8Config  # noqa: E402
from hf_fp8.modules.fp8_experts import Fp8Experts, is_experts_module  # noqa: E402
from hf_fp8.modules.selection import high_precision_parts  # noqa: E402
from hf_fp8.numerics import is_fp8  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VOCAB = 128
# config fields that size a model, shrunk to tiny values when the default config has them
SHRINK = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "n_embed": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "ffn_hidden_size": 128,  # LongCat-Flash
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "attention_hidden_size": 128,  # Zamba: 2 x hidden
    "attention_head_dim": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "rotary_dim": 8,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_decoder_layers": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 0,
}
_LAYER_TYPE_KEYS = ("layer_types", "mlp_layer_types", "layers_block_type")


def _shrunk(defaults: dict) -> dict:
    kwargs = {k: v for k, v in SHRINK.items() if k in defaults}
    if "kv_lora_rank" in defaults and "num_key_value_heads" in kwargs:  # MLA: one kv per head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    # hybrid stacks keep one layer of each kind (attention, linear attention, mamba ...)
    kinds: list = []
    for key in _LAYER_TYPE_KEYS:
        value = defaults.get(key)
        if isinstance(value, list) and value:
            kinds = list(dict.fromkeys(value))
    layers = max(2, len(kinds))
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in kwargs:
            kwargs[key] = layers
    for key in _LAYER_TYPE_KEYS:
        value = defaults.get(key)
        if isinstance(value, list) and value:
            unique = list(dict.fromkeys(value))
            kwargs[key] = (unique * layers)[:layers]
    return kwargs


def tiny_config(model_type: str) -> tf.PretrainedConfig:
    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    kwargs = _shrunk(defaults)
    text = defaults.get("text_config")
    if isinstance(text, dict):
        kwargs["text_config"] = {**text, **_shrunk(text)}
    return cls(**kwargs)


def _embedding_params(model: nn.Module) -> set[int]:
    out = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            out.update(id(p) for p in module.parameters())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        out.update(id(p) for p in head.parameters(recurse=False))
    return out


_NOT_COUNTED = ("embeddings", "output head")  # out of the share, as the issue counts


def why_high_precision(model: nn.Module, total: int, *, skip: list[str], top: int = 3) -> list:
    """The largest parts of ``model`` that stay high precision, with their share of the
    ``total`` non-embedding parameters and the reason (``selection.high_precision_parts``)."""
    parts = [g for g in high_precision_parts(model, skip=skip) if g["what"] not in _NOT_COUNTED]
    return [
        {
            "what": g["what"],
            "share": g["parameters"] / total if total else 0.0,
            "why": g["why"],
            "examples": g["examples"][:2],
        }
        for g in parts[:top]
    ]


def fp8_share(model: nn.Module, embedding_ids: set[int]) -> tuple[int, int, list[dict]]:
    """(fp8 elements, non-embedding elements, the largest high-precision parts and why)."""
    fp8 = total = 0
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in embedding_ids or "scale" in pname:
                continue
            total += p.numel()
            if is_fp8(p.dtype):
                fp8 += p.numel()
    return fp8, total, why_high_precision(model, total, skip=[])


def full_size_share(model_type: str) -> dict:
    """The FP8 share the quantizer's swap gives the *default* (full-size) config, counted on
    the meta device with the same rules (``convertible_modules``, ``experts_to_convert``;
    ``lm_head`` and embeddings out of both counts)."""
    from hf_fp8.modules import convertible_modules
    from hf_fp8.quantizer.experts import experts_to_convert

    cls = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        model = cls(CONFIG_MAPPING[model_type]())
    embeddings = _embedding_params(model)
    fp8 = 0
    seen: set[int] = set()  # a layer shared by several parents (Zamba2) counts once
    for _, module, _ in convertible_modules(model, skip=["lm_head"]):
        if id(module.weight) not in seen:
            seen.add(id(module.weight))
            fp8 += module.weight.numel()
    for _, module, _, _ in experts_to_convert(model, skip=["lm_head"]):
        for n, p in module.named_parameters(recurse=False):
            if not n.endswith("bias") and id(p) not in seen:
                seen.add(id(p))
                fp8 += p.numel()
    total = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    return {
        "full_size_fp8_share": fp8 / total,
        "full_size_parameters": total,
        "full_size_high_precision": why_high_precision(model, total, skip=["lm_head"]),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.element_size() == 1:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        if not torch.equal(x, y):
            return False
    return True


MAX_PARAMS = 10_000_000  # a config the shrink missed builds on meta first, then is skipped


class FamilyTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise FamilyTimeout("took longer than the per-family limit")


def measure(model_type: str, workdir: Path) -> dict:
    torch.manual_seed(0)
    config = tiny_config(model_type)
    cls = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {size} parameters")
    ref = cls(config).eval()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits.float()
    hp, fp8_dir = workdir / model_type / "hp", workdir / model_type / "fp8"
    ref.save_pretrained(hp)
    model = tf.AutoModelForCausalLM.from_pretrained(hp, quantization_config=Fp8Config("dynamic"))
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits.float()
    fp8, total, high = fp8_share(model, _embedding_params(model))
    model.save_pretrained(fp8_dir)
    back = tf.AutoModelForCausalLM.from_pretrained(fp8_dir).eval()
    with torch.no_grad():
        again = back(input_ids=ids, use_cache=False).logits.float()
    moe = any(is_experts_module(m) for m in model.modules())
    return {
        "moe": moe,
        "fp8_experts": sum(isinstance(m, Fp8Experts) for m in model.modules()),
        "fp8_share": fp8 / total if total else 0.0,
        "non_embedding_parameters": total,
        "high_precision": high,
        "rel_error": float((got - want).norm() / want.norm()),
        "reload_identical": _same(model.state_dict(), back.state_dict())
        and torch.equal(got, again),
    }


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((k, v) for k, v in rows.items() if "fp8_share" in v)
    fig, ax = plt.subplots(figsize=(max(8, len(ok) * 0.16), 4))
    colors = ["tab:orange" if v["moe"] else "tab:blue" for _, v in ok]
    ax.bar(range(len(ok)), [v["fp8_share"] for _, v in ok], color=colors)
    full = [v.get("full_size_fp8_share", math.nan) for _, v in ok]
    ax.plot(range(len(ok)), full, "k.", ms=3, label="default (full-size) config")
    ax.legend(loc="lower left", fontsize=7)
    ax.axhline(0.99, color="k", ls="--", lw=0.8)
    ax.set_xticks(range(len(ok)), [k for k, _ in ok], rotation=90, fontsize=5)
    ax.set_ylim(0.8, 1.0)
    ax.set_ylabel("FP8 share of non-embedding params")
    ax.set_title(
        "hf_fp8 coverage: bars tiny models (orange: MoE), dots full-size; dashed: 0.99 target "
        "(bars below 0.8 are cut)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated model_types")
    parser.add_argument("--quick", action="store_true", help="a dozen families")
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop starting families")
    parser.add_argument(
        "--no-full-size",
        dest="full_size",
        action="store_false",
        help="skip the share of each default (full-size) config, counted on meta",
    )
    parser.add_argument("--family-limit-s", type=int, default=10)
    parser.add_argument("--output", type=Path, default=RESULTS / "moe_coverage.json")
    args = parser.parse_args(argv)
    families = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.families:
        families = args.families.split(",")
    elif args.quick:
        quick = "llama qwen3 gpt2 falcon mistral qwen3_moe mixtral olmoe deepseek_v3 gpt_oss"
        families = quick.split()
    torch.set_num_threads(1)
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    rows: dict[str, dict] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            if time.perf_counter() - start > args.budget_s:
                rows[family] = {"error": "not run: time budget spent"}
                continue
            t0 = time.perf_counter()
            signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(args.family_limit_s)
            try:
                with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                    warnings.simplefilter("ignore")
                    rows[family] = measure(family, Path(tmp))
            except Exception as err:  # a family that does not build / run tiny
                rows[family] = {"error": f"{type(err).__name__}: {str(err)[:160]}"}
            finally:
                signal.alarm(0)
            if args.full_size:
                signal.alarm(args.family_limit_s)
                try:
                    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                        warnings.simplefilter("ignore")
                        rows[family].update(full_size_share(family))
                except Exception as err:
                    rows[family]["full_size_error"] = f"{type(err).__name__}: {str(err)[:160]}"
                finally:
                    signal.alarm(0)
            rows[family]["seconds"] = round(time.perf_counter() - t0, 2)
            row = rows[family]
            if "error" not in row:
                full = row.get("full_size_fp8_share", math.nan)
                print(
                    f"{family:28s} moe={row['moe']!s:5s} share={row['fp8_share']:.4f} "
                    f"full={full:.4f} err={row['rel_error']:.4f} "
                    f"reload={row['reload_identical']}",
                    flush=True,
                )
    ok = {k: v for k, v in rows.items() if "fp8_share" in v}
    shares = [v["fp8_share"] for v in ok.values()]
    full = {k: v["full_size_fp8_share"] for k, v in rows.items() if "full_size_fp8_share" in v}
    summary = {
        "transformers": tf.__version__,
        "families_tried": len(rows),
        "families_measured": len(ok),
        "moe_families": sum(v["moe"] for v in ok.values()),
        "min_fp8_share": min(shares) if shares else math.nan,
        "below_0.99": sorted(k for k, v in ok.items() if v["fp8_share"] < 0.99),
        "full_size_measured": len(full),
        "full_size_min_fp8_share": min(full.values()) if full else math.nan,
        "full_size_below_0.99": sorted(k for k, v in full.items() if v < 0.99),
        # for each family below the target at full size: its largest high-precision part
        "full_size_below_0.99_why": {
            k: [
                f"{g['what']} {g['share']:.3f}: {g['why']}"
                for g in rows[k]["full_size_high_precision"][:1]
            ]
            for k in sorted(full)
            if full[k] < 0.99
        },
        "reload_not_identical": sorted(k for k, v in ok.items() if not v["reload_identical"]),
        "median_rel_error": sorted(v["rel_error"] for v in ok.values())[len(ok) // 2]
        if ok
        else math.nan,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "families": rows}, indent=2) + "\n")
    if ok:
        plot(rows, args.output.with_suffix(".png"))
    return summary


if __name__ == "__main__":
    main()
