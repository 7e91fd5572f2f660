"""Quantize the real all-MiniLM-L6-v2 with every scheme; compare with fp32; save and reload.

    python examples/quantize_minilm.py [--model PATH] [--out DIR] [--sentences 64]

Prints one table: linear-weight bytes, mean cosine of sentence embeddings vs fp32, forward
time ratio vs fp32, and whether the saved checkpoint reloads bit-identically.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModel, AutoTokenizer

import hf_fp8
from hf_fp8.utils.corpus import stdlib_sentences
from hf_fp8.utils.minilm import default_model_path, linear_weight_bytes, sentence_embeddings

SCHEMES = {
    "weight_only": hf_fp8.Fp8Config("weight_only"),
    "dynamic": hf_fp8.Fp8Config("dynamic"),
    "static": hf_fp8.Fp8Config("static"),
}


def _timed(fn, repeat: int = 2) -> tuple[torch.Tensor, float]:
    result = fn()  # warm-up (compiles the emulation kernels once)
    start = time.perf_counter()
    for _ in range(repeat):
        result = fn()
    return result, (time.perf_counter() - start) / repeat


def _identical(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8))
        for k in sa
    )


def _run(args: argparse.Namespace, out_root: str) -> list[tuple]:
    """Every scheme: quantize, measure, save into ``out_root`` and reload."""
    path = args.model or default_model_path()
    sentences = stdlib_sentences(args.sentences + 64, seed=0)
    evaluation, calibration = sentences[: args.sentences], sentences[args.sentences :]
    tokenizer = AutoTokenizer.from_pretrained(path)

    base = AutoModel.from_pretrained(path, dtype=torch.float32)
    ref, t_ref = _timed(lambda: sentence_embeddings(base, tokenizer, evaluation))
    ref_bytes, params = linear_weight_bytes(base)
    rows = [("fp32", ref_bytes / params, 1.0, 1.0, "-")]

    for name, config in SCHEMES.items():
        model = AutoModel.from_pretrained(path, dtype=torch.float32, quantization_config=config)
        if config.activation_scheme == "static":
            batches = [
                tokenizer(calibration[i : i + 16], padding=True, return_tensors="pt")
                for i in range(0, len(calibration), 16)
            ]
            hf_fp8.calibrate(model, batches, observer="minmax", progress=False)
        emb, t = _timed(lambda m=model: sentence_embeddings(m, tokenizer, evaluation))
        cosine = float((emb * ref).sum(-1).mean())
        nbytes, n = linear_weight_bytes(model)
        save_dir = os.path.join(out_root, f"minilm-fp8-{name}")
        model.save_pretrained(save_dir)
        reloaded = AutoModel.from_pretrained(save_dir)
        rows.append(
            (name, nbytes / n, cosine, t / t_ref, "yes" if _identical(model, reloaded) else "NO")
        )

    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: built-in MiniLM)")
    parser.add_argument(
        "--out",
        default=None,
        help="keep the FP8 checkpoints here (default: a temporary folder, removed)",
    )
    parser.add_argument("--sentences", type=int, default=64)
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        out_root = args.out or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="hf_fp8_demo_")
        )
        rows = _run(args, out_root)
    where = args.out or "a temporary folder (removed; pass --out DIR to keep them)"
    print(f"\nall-MiniLM-L6-v2, {args.sentences} sentences, checkpoints in {where}\n")
    print("| scheme | linear bytes/param | mean cosine vs fp32 | time vs fp32 | reload identical |")
    print("|---|---|---|---|---|")
    for name, bpp, cos, ratio, same in rows:
        print(f"| {name} | {bpp:.3f} | {cos:.5f} | {ratio:.2f}x | {same} |")
    return {
        name: {"bytes_per_param": b, "cosine": c, "time_ratio": r, "reload_identical": s}
        for name, b, c, r, s in rows
    }


if __name__ == "__main__":
    main()
