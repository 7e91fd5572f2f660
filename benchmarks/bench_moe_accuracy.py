"""Output error of tiny MoE models in FP8 against dense models of the same family and size.

    python benchmarks/bench_moe_accuracy.py [--seeds 8] [--pairs qwen3_moe,mixtral]

Issue 11's target: the relative output error of a tiny MoE model in each scheme is within
1.2x that of a dense model of the same family and size. For each pair (MoE family, its dense
counterpart) both are built from their config classes with the same vocabulary, hidden size,
layers and attention; the MoE has ``EXPERTS`` experts of width ``EXPERT_WIDTH``, top
``TOP_K``, and the dense MLP is as wide as what one token reaches (``TOP_K * EXPERT_WIDTH``,
plus the shared expert where the family has one). Each model is quantized with
``quantize_model(Fp8Config(scheme), skip=["lm_head"])`` (``static``: calibrated with
``hf_fp8.calibrate`` on other batches) and measured on a fixed batch:

* ``rel_error``: ``||logits_fp8 - logits_fp32|| / ||logits_fp32||``, pooled over seeds
  (squared norms summed over the seeds' models, then the root);
* ``ratio``: MoE error / dense error, ``ok``: ratio <= 1.2;
* MoE only, the diagnosis: ``routing_flips`` — the share of (token, layer) whose top-k
  expert *set* differs from the fp32 model's; ``rel_error_fp32_routing`` — the same error
  when every experts module is handed the fp32 model's routing (index and weights), i.e.
  without the flips; ``ratio_fp32_routing`` against the dense error (``null`` for
  Llama-4, whose experts get rows pre-scaled by the router: not replayable);
  ``ratio_vs_one_expert`` — against the MoE family's own code with one expert as wide as
  the dense MLP, top-1 (a dense model of the same architecture: when the dense family
  differs in more than its MLP, e.g. OLMo vs OLMoE's q/k norms, this isolates the experts;
  Llama-4's shared expert is as wide as its experts, so there it is 2x wider too).

Writes ``benchmarks/results/moe_accuracy.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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

import hf_fp8  # noqa: E402
from hf_fp8 import Fp8Config, quantize_model  # noqa: E402
from hf_fp8.modules.fp8_experts import is_experts_module  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VOCAB, EXPERTS, TOP_K, EXPERT_WIDTH, SHARED_WIDTH = 128, 8, 2, 64, 64
SCHEMES = ("weight_only", "dynamic", "static")
TARGET = 1.2
# (MoE model_type, dense model_type of the same family)
PAIRS = (
    ("qwen3_moe", "qwen3"),
    ("qwen2_moe", "qwen2"),
    ("mixtral", "mistral"),
    ("olmoe", "olmo"),
    ("granitemoe", "granite"),
    ("ernie4_5_moe", "ernie4_5"),
    ("llama4_text", "llama"),  # Llama-4's experts: Fp8BmmExperts
)
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_k")
_EXPERT_WIDTH = ("moe_intermediate_size", "expert_intermediate_size")
# every layer sparse (Qwen2/3-MoE, DeepSeek-style and ERNIE-4.5 spellings)
_SPARSE_EVERYWHERE = {
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "first_k_dense_replace": 0,
    "moe_layer_start_index": 0,
    "moe_layer_end_index": COMMON["num_hidden_layers"] - 1,
    "moe_layer_interval": 1,
}


def _known(model_type: str, wanted: dict) -> dict:
    defaults = CONFIG_MAPPING[model_type]().to_dict()
    return {k: v for k, v in wanted.items() if k in defaults}


def _moe_kwargs(moe_type: str, experts: int, top_k: int, width: int) -> tuple[dict, int]:
    """Config kwargs of a tiny ``moe_type`` model (``experts`` of ``width``, top ``top_k``)
    and the width of its shared expert (0: none)."""
    defaults = CONFIG_MAPPING[moe_type]().to_dict()
    moe = dict(COMMON, **_SPARSE_EVERYWHERE)
    moe.update({k: experts for k in _EXPERT_COUNT})
    moe.update({k: top_k for k in _TOP_K})
    width_keys = [k for k in _EXPERT_WIDTH if k in defaults] or ["intermediate_size"]
    moe.update({k: width for k in width_keys})
    if "shared_expert_intermediate_size" in defaults:
        moe["shared_expert_intermediate_size"] = SHARED_WIDTH
    elif defaults.get("moe_num_shared_experts"):
        moe["moe_num_shared_experts"] = 1
    kwargs = _known(moe_type, moe)
    shared = _shared_width(CONFIG_MAPPING[moe_type](**kwargs))
    if "intermediate_size" not in width_keys:
        kwargs["intermediate_size"] = TOP_K * EXPERT_WIDTH + shared  # dense layers, if any
    return kwargs, shared


def _shared_width(config: tf.PretrainedConfig) -> int:
    """Width of the shared expert of the first MoE layer (0: none), read from the model
    built on meta: the first linear reading the hidden size under a ``shared_expert*``."""
    with torch.device("meta"):
        model = build(config, 0)
    for name, module in model.named_modules():
        if name.rpartition(".")[2].startswith("shared_expert") and not isinstance(
            module, nn.Linear
        ):
            for child in module.modules():
                if isinstance(child, nn.Linear) and child.in_features == config.hidden_size:
                    return child.out_features
    return 0


def pair_configs(
    moe_type: str, dense_type: str
) -> tuple[tf.PretrainedConfig, tf.PretrainedConfig, tf.PretrainedConfig]:
    """Configs of one pair: the MoE; the dense family model with the same attention and
    sizes and an MLP as wide as the experts one token reaches (top-k experts, plus the shared
    expert when the family has one); and the MoE's own code with one expert of that width,
    top-1 (a dense model of the *same* architecture, to tell experts from architecture)."""
    moe, shared = _moe_kwargs(moe_type, EXPERTS, TOP_K, EXPERT_WIDTH)
    one, _ = _moe_kwargs(moe_type, 1, 1, TOP_K * EXPERT_WIDTH)
    dense = dict(COMMON, intermediate_size=TOP_K * EXPERT_WIDTH + shared)
    return (
        CONFIG_MAPPING[moe_type](**moe),
        CONFIG_MAPPING[dense_type](**_known(dense_type, dense)),
        CONFIG_MAPPING[moe_type](**one),
    )


def build(config: tf.PretrainedConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    cls = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])
    return cls(config).eval()


def _ids(seed: int, batch: int = 4, length: int = 32) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def quantized(model: nn.Module, scheme: str, calibration: list[torch.Tensor]) -> nn.Module:
    """An FP8 copy of ``model`` in ``scheme`` (``static``: calibrated on ``calibration``)."""
    out = quantize_model(copy.deepcopy(model), Fp8Config(scheme), skip=["lm_head"])
    if scheme == "static":
        hf_fp8.calibrate(out, [{"input_ids": ids} for ids in calibration], progress=False)
    return out.eval()


@contextmanager
def routing(model: nn.Module, replay: list | None = None) -> Iterator[list]:
    """Record the ``(top_k_index, top_k_weights)`` every experts module receives, in call
    order; with ``replay``, hand each call the recorded routing of another model instead.
    Experts called with rows grouped per expert (Llama-4's bmm experts, no routing argument)
    record ``(mask [T, E] of the rows that are non-zero, None)``: not replayable."""
    seen: list = []

    def hook(module, args, kwargs):
        args = list(args)
        names = ("top_k_index", "top_k_weights")
        if len(args) < 3 and names[0] not in kwargs:
            x = args[0] if args else kwargs["hidden_states"]
            live = (x.reshape(module.num_experts, -1, x.shape[-1]) != 0).any(dim=-1)
            seen.append([live.T, None])
            return None
        call = [args[i + 1] if len(args) > i + 1 else kwargs[n] for i, n in enumerate(names)]
        if replay is not None:
            call = replay[len(seen)]
            for i, n in enumerate(names):
                if len(args) > i + 1:
                    args[i + 1] = call[i]
                else:
                    kwargs[n] = call[i]
        seen.append([t.detach() for t in call])
        return tuple(args), kwargs

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in model.modules()
        if is_experts_module(m)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _flips(ref: list, got: list) -> tuple[int, int]:
    """(tokens whose top-k set differs, tokens) over every experts call."""
    flipped = total = 0
    for (a, _), (b, _) in zip(ref, got, strict=True):
        if a.dtype != torch.bool:  # expert ids: compare the sets
            a, b = a.sort(dim=-1).values, b.sort(dim=-1).values
        flipped += int((a != b).any(dim=-1).sum())
        total += a.shape[0]
    return flipped, total


def measure(config: tf.PretrainedConfig, scheme: str, seeds: int) -> dict:
    """Pooled relative logit error of ``config``'s model in ``scheme`` over ``seeds`` models;
    for MoE models also the routing flips and the error with the fp32 routing."""
    err = ref_sq = err_fixed = 0.0
    flipped = tokens = 0
    moe = False
    for seed in range(seeds):
        model = build(config, seed)
        ids = _ids(1000 + seed)
        calibration = [_ids(2000 + 10 * seed + i) for i in range(4)]
        fp8 = quantized(model, scheme, calibration)
        with torch.no_grad():
            with routing(model) as ref_routing:
                want = model(input_ids=ids, use_cache=False).logits.float()
            with routing(fp8) as fp8_routing:
                got = fp8(input_ids=ids, use_cache=False).logits.float()
            ref_sq += float(want.pow(2).sum())
            err += float((got - want).pow(2).sum())
            if ref_routing:
                moe = True
                f, t = _flips(ref_routing, fp8_routing)
                flipped, tokens = flipped + f, tokens + t
                if any(weights is None for _, weights in ref_routing):
                    err_fixed = math.nan  # routing not replayable (bmm experts)
                    continue
                with routing(fp8, replay=ref_routing):
                    fixed = fp8(input_ids=ids, use_cache=False).logits.float()
                err_fixed += float((fixed - want).pow(2).sum())
    row = {"rel_error": math.sqrt(err / ref_sq)}
    if moe:
        row["routing_flips"] = flipped / tokens
        row["rel_error_fp32_routing"] = math.sqrt(err_fixed / ref_sq)
    return row


def _finite(x: float) -> float | None:
    """``x``, or ``None`` (JSON ``null``) when it is not a number (not measured)."""
    return x if math.isfinite(x) else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--pairs", default="", help="comma-separated MoE model_types")
    parser.add_argument("--output", type=Path, default=RESULTS / "moe_accuracy.json")
    args = parser.parse_args(argv)
    pairs = [p for p in PAIRS if not args.pairs or p[0] in args.pairs.split(",")]
    torch.set_num_threads(1)
    tf.logging.set_verbosity_error()
    rows: dict[str, dict] = {}
    start = time.perf_counter()
    for moe_type, dense_type in pairs:
        try:
            moe_cfg, dense_cfg, one_cfg = pair_configs(moe_type, dense_type)
        except Exception as err:  # a family whose config refuses the tiny sizes
            rows[moe_type] = {"dense": dense_type, "error": f"{type(err).__name__}: {err}"[:200]}
            continue
        row: dict = {"dense": dense_type}
        for scheme in SCHEMES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = measure(moe_cfg, scheme, args.seeds)
                d = measure(dense_cfg, scheme, args.seeds)
                one = measure(one_cfg, scheme, args.seeds)
            cell = {
                "moe_rel_error": m["rel_error"],
                "dense_rel_error": d["rel_error"],
                "ratio": m["rel_error"] / d["rel_error"],
                "routing_flips": m.get("routing_flips"),
                "ratio_fp32_routing": _finite(
                    m.get("rel_error_fp32_routing", math.nan) / d["rel_error"]
                ),
                "one_expert_rel_error": one["rel_error"],
                "ratio_vs_one_expert": m["rel_error"] / one["rel_error"],
            }
            cell["ok"] = cell["ratio"] <= TARGET
            row[scheme] = cell
            print(
                f"{moe_type:14s} vs {dense_type:10s} {scheme:11s} moe={cell['moe_rel_error']:.4f}"
                f" dense={cell['dense_rel_error']:.4f} ratio={cell['ratio']:.2f}"
                f" flips={cell['routing_flips']:.3f}"
                f" ratio(fp32 routing)={cell['ratio_fp32_routing'] or math.nan:.2f}"
                f" ratio(vs 1 expert)={cell['ratio_vs_one_expert']:.2f}",
                flush=True,
            )
        rows[moe_type] = row
    cells = [(k, s, v[s]) for k, v in rows.items() for s in SCHEMES if s in v]
    summary = {
        "transformers": tf.__version__,
        "torch": torch.__version__,
        "seeds": args.seeds,
        "target_ratio": TARGET,
        "sizes": {"experts": EXPERTS, "top_k": TOP_K, "expert_width": EXPERT_WIDTH, **COMMON},
        "pairs_measured": sum("error" not in v for v in rows.values()),
        "cells_ok": sum(c["ok"] for _, _, c in cells),
        "cells": len(cells),
        "missed": sorted(f"{k}/{s}" for k, s, c in cells if not c["ok"]),
        "missed_with_fp32_routing": sorted(
            f"{k}/{s}" for k, s, c in cells if (c["ratio_fp32_routing"] or 0) > TARGET
        ),
        "missed_vs_one_expert": sorted(
            f"{k}/{s}" for k, s, c in cells if not c["ratio_vs_one_expert"] <= TARGET
        ),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "pairs": rows}, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
