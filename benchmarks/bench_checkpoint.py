"""Checkpoint size and load time: hf_fp8 pre-quantized vs the bf16 original, same run.

    python benchmarks/bench_checkpoint.py [--quick]

A Llama-shaped model (random weights; Llama-2-7B's proportions scaled down: MHA,
intermediate = 2.6875 × hidden, embeddings + untied head ≈ 4 % of the parameters) is saved
in bf16, quantized on load with Fp8Config("dynamic") and saved again; then each checkpoint
is loaded ``repeats`` times (interleaved) and the median load times are compared. The
output head stays in bf16, as transformers' default skips keep it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import hf_fp8

RESULTS = Path(__file__).parent / "results"


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _load_seconds(path: Path) -> tuple[float, float]:
    """(from_pretrained returns, + first forward of one token).

    safetensors maps the file lazily, so from_pretrained alone measures per-tensor overhead;
    the first forward reads every weight once (from the page cache here).
    """
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    returned = time.perf_counter() - start
    with torch.no_grad():
        model(torch.ones(1, 1, dtype=torch.long))
    return returned, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repeats")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    hidden, layers, repeats = (1024, 4, 3) if args.quick else (2048, 8, 15)
    config = LlamaConfig(
        vocab_size=2 * hidden,
        hidden_size=hidden,
        intermediate_size=int(2.6875 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="hf_fp8_ckpt_"))
    bf16_dir, fp8_dir = root / "bf16", root / "fp8"
    torch.set_default_dtype(torch.bfloat16)
    try:
        LlamaForCausalLM(config).save_pretrained(bf16_dir)
    finally:
        torch.set_default_dtype(torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(
        bf16_dir, dtype=torch.bfloat16, quantization_config=hf_fp8.Fp8Config("dynamic")
    )
    quantized.save_pretrained(fp8_dir)

    tensors = load_file(fp8_dir / "model.safetensors")
    fp8_keys = [k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn]
    linear_bytes = sum(
        tensors[k].nbytes + tensors[k.removesuffix("weight") + "weight_scale"].nbytes
        for k in fp8_keys
    )
    linear_params = sum(tensors[k].numel() for k in fp8_keys)

    times = {"bf16": [], "fp8": []}
    # warm the page cache, imports and the compiled FP8 emulation kernels
    _load_seconds(bf16_dir), _load_seconds(fp8_dir)
    for _ in range(repeats):
        times["bf16"].append(_load_seconds(bf16_dir))
        times["fp8"].append(_load_seconds(fp8_dir))
    median = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    touched = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
    results = {
        "params": sum(p.numel() for p in quantized.parameters()),
        "bf16_bytes": _dir_bytes(bf16_dir),
        "fp8_bytes": _dir_bytes(fp8_dir),
        "size_ratio": _dir_bytes(fp8_dir) / _dir_bytes(bf16_dir),
        "linear_bytes_per_param": linear_bytes / linear_params,
        "load_seconds_median": median,
        "load_time_ratio": median["fp8"] / median["bf16"],
        "load_and_first_forward_seconds_median": touched,
        "load_and_first_forward_ratio": touched["fp8"] / touched["bf16"],
        "repeats": repeats,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint.json").write_text(json.dumps(results, indent=2))
    print("| checkpoint | bytes | from_pretrained (s) | + first forward (s) |\n|---|---|---|---|")
    for key, name in (("bf16", "bf16"), ("fp8", "hf_fp8 dynamic")):
        print(f"| {name} | {results[key + '_bytes']:,} | {median[key]:.3f} | {touched[key]:.3f} |")
    print(
        f"size ratio {results['size_ratio']:.3f} (target ≤ 0.55), linear bytes/param "
        f"{results['linear_bytes_per_param']:.4f} (≤ 1.01), load-time ratio "
        f"{results['load_time_ratio']:.2f}, with the first forward "
        f"{results['load_and_first_forward_ratio']:.2f}"
        " (≤ 1.2)"
    )
    return results


if __name__ == "__main__":
    main()
