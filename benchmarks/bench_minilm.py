"""Fidelity on the real all-MiniLM-L6-v2: sentence embeddings vs fp32 (mean cosine).

    python benchmarks/bench_minilm.py [--quick]

Baselines measured in the same run on the same sentences: a plain per-row fake-quantization
of the weights (and of per-token activations), written here in a few lines of torch,
independent of hf_fp8; torchao's Float8WeightOnlyConfig where it runs on this machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from transformers import AutoModel, AutoTokenizer

import hf_fp8
from hf_fp8.utils.corpus import stdlib_sentences
from hf_fp8.utils.minilm import default_model_path, sentence_embeddings

RESULTS = Path(__file__).parent / "results"
TARGETS = {"weight_only": 0.9985, "dynamic": 0.9977, "static": 0.995}


def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class _FakeQuantLinear(nn.Module):
    """Reference: per-row fake-quantized weight, optionally per-token activations."""

    def __init__(self, linear: nn.Linear, activations: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(_fake_quant_rows(linear.weight.detach().float()))
        self.bias, self.activations = linear.bias, activations

    def forward(self, x):
        x = _fake_quant_rows(x) if self.activations else x
        return nn.functional.linear(x, self.weight, self.bias)


def _reference_model(base: nn.Module, activations: bool) -> nn.Module:
    model = copy.deepcopy(base)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not name.startswith("pooler"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _FakeQuantLinear(module, activations))
    return model


def _torchao_weight_only(base: nn.Module) -> nn.Module | None:
    try:
        from torchao.quantization import Float8WeightOnlyConfig, quantize_

        model = copy.deepcopy(base)
        quantize_(model, Float8WeightOnlyConfig())
        return model
    except Exception as err:  # not supported on this machine / version
        print(f"torchao Float8WeightOnlyConfig skipped: {type(err).__name__}: {err}")
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 sentences instead of 256")
    parser.add_argument("--model", default=None, help="model folder (default: built-in MiniLM)")
    args = parser.parse_args(argv)
    n = 64 if args.quick else 256
    path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = stdlib_sentences(n + 64, seed=0)
    evaluation, calibration = text[:n], text[n:]
    base = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    reference = sentence_embeddings(base, tokenizer, evaluation)

    def cosine(model: nn.Module) -> float:
        return float((sentence_embeddings(model, tokenizer, evaluation) * reference).sum(-1).mean())

    results: dict[str, float] = {
        "baseline: per-row weight fake-quant": cosine(_reference_model(base, False)),
        "baseline: per-row weight + per-token activation fake-quant": cosine(
            _reference_model(base, True)
        ),
    }
    torchao_model = _torchao_weight_only(base)
    if torchao_model is not None:
        results["torchao Float8WeightOnlyConfig"] = cosine(torchao_model)
    batches = [
        tokenizer(calibration[i : i + 16], padding=True, return_tensors="pt")
        for i in range(0, len(calibration), 16)
    ]
    for method in ("absmax", "mse"):
        for scheme in ("weight_only", "dynamic", "static"):
            config = hf_fp8.Fp8Config(scheme, weight_scale_method=method)
            model = AutoModel.from_pretrained(path, dtype=torch.float32, quantization_config=config)
            if scheme == "static":
                hf_fp8.calibrate(model, batches, observer="minmax", progress=False)
            suffix = "" if method == "absmax" else f", weight_scale_method='{method}'"
            results[f"hf_fp8 {scheme}{suffix}"] = cosine(model)

    RESULTS.mkdir(exist_ok=True)
    payload = {"sentences": n, "mean_cosine": results, "targets": TARGETS}
    (RESULTS / "minilm.json").write_text(json.dumps(payload, indent=2))
    print(f"\nall-MiniLM-L6-v2, {n} sentences (stdlib docstrings), mean cosine vs fp32\n")
    print("| model | mean cosine | target |\n|---|---|---|")
    for name, value in results.items():
        scheme = name.removeprefix("hf_fp8 ").split(",")[0]
        target = TARGETS.get(scheme) if name.startswith("hf_fp8") else None
        shown = f"≥ {target:.4f}" if target else ""
        print(f"| {name} | {value:.5f} | {shown} |")
    return payload


if __name__ == "__main__":
    main()
