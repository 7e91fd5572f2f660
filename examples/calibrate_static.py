"""Static FP8 activations on all-MiniLM-L6-v2: give a scale, or calibrate it from data.

    python examples/calibrate_static.py [--model PATH] [--batches 4]

Compares each observer (and one hand-given scale for every layer) by the mean cosine of
sentence embeddings against fp32, then saves and reloads the calibrated model.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModel, AutoTokenizer

import hf_fp8
from hf_fp8.utils.corpus import stdlib_sentences
from hf_fp8.utils.minilm import default_model_path, sentence_embeddings


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: built-in MiniLM)")
    parser.add_argument("--batches", type=int, default=4, help="calibration batches of 16")
    parser.add_argument("--sentences", type=int, default=128, help="evaluation sentences")
    parser.add_argument(
        "--out", default=None, help="keep the calibrated model here (default: temporary, removed)"
    )
    args = parser.parse_args(argv)

    path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = stdlib_sentences(args.sentences + 16 * args.batches, seed=1)
    evaluation, calibration = text[: args.sentences], text[args.sentences :]
    batches = [
        tokenizer(calibration[i : i + 16], padding=True, return_tensors="pt")
        for i in range(0, len(calibration), 16)
    ]
    reference = sentence_embeddings(AutoModel.from_pretrained(path), tokenizer, evaluation)

    def cosine(model: torch.nn.Module) -> float:
        return float((sentence_embeddings(model, tokenizer, evaluation) * reference).sum(-1).mean())

    results = {}
    given = AutoModel.from_pretrained(
        path, quantization_config=hf_fp8.Fp8Config("static", activation_scale=0.05)
    )
    results["given scale 0.05 (all layers)"] = cosine(given)
    for observer in ("minmax", "moving_average", "percentile", "mse"):
        model = AutoModel.from_pretrained(path, quantization_config=hf_fp8.Fp8Config("static"))
        hf_fp8.calibrate(model, batches, observer=observer)
        results[f"calibrated: {observer}"] = cosine(model)

    with tempfile.TemporaryDirectory(prefix="hf_fp8_static_") as tmp:
        out = args.out or tmp
        model.save_pretrained(out)
        reloaded = AutoModel.from_pretrained(out)  # scales come back from the checkpoint
        assert cosine(reloaded) == results["calibrated: mse"]
    where = args.out or "a temporary folder (removed; pass --out DIR to keep it)"

    print("\n| static activation scales | mean cosine vs fp32 |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.5f} |")
    print(f"\nsaved the mse-calibrated model to {where} and reloaded it with identical outputs")
    return results


if __name__ == "__main__":
    main()
