"""inspect_checkpoint against the files on disk; conversions write only their output folder."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub.constants
import pytest
from safetensors import safe_open

import hf_fp8
from hf_fp8.serialization import inspect_checkpoint
from tests.hub.fake_hub import block_network
from tests.serialization.helpers import quantized


def _bytes_by_kind(path: Path) -> tuple[int, int, int]:
    fp8 = scales = other = 0
    with safe_open(path / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118
            t = f.get_tensor(key)
            n = t.numel() * t.element_size()
            if t.dtype.itemsize == 1 and key.endswith(".weight"):
                fp8 += n
            elif key.rsplit(".", 1)[-1] in ("weight_scale", "weight_scale_inv", "input_scale"):
                scales += n
            else:
                other += n
    return fp8, scales, other


@pytest.mark.parametrize(
    ("scheme", "fmt", "text"),
    [
        (
            "dynamic-row-token",
            "hf_fp8",
            "dynamic: e4m3 weights per output channel, activations e4m3 per token",
        ),
        (
            "static-tensor",
            "compressed-tensors",
            "static: e4m3 weights per tensor, activations e4m3 per tensor (static",
        ),
        ("dynamic-block", "vllm-fp8", "per block 32×32, activations e4m3 per 1×32 group"),
        ("weight_only-row", "compressed-tensors", "activations float32 (weight-only)"),
    ],
)
def test_summary_matches_files(scheme, fmt, text, tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), scheme)
    path = tmp_path / "fp8"
    model.save_pretrained(path)
    if fmt != "hf_fp8":
        path = hf_fp8.export(path, tmp_path / fmt, fmt)
    summary = inspect_checkpoint(path)
    assert summary.format == fmt
    assert text in summary.scheme_text
    assert len(summary.fp8_layers) == 14 and summary.high_precision_layers == ["lm_head"]
    assert (summary.fp8_weight_bytes, summary.scale_bytes, summary.other_bytes) == _bytes_by_kind(
        path
    )
    assert summary.bytes_before == 4 * summary.fp8_weight_bytes + summary.other_bytes
    assert summary.to_dict()["total_bytes"] == sum(_bytes_by_kind(path))


def test_summary_of_unquantized_checkpoint(tiny_model_dir):
    summary = inspect_checkpoint(tiny_model_dir("llama"))
    assert summary.format == "unquantized" and summary.fp8_layers == [] and summary.scheme is None


def _tree(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")}


def _listing(folder: Path) -> set[str]:
    return set(os.listdir(folder)) if folder.is_dir() else set()


def test_conversions_write_only_their_output_folder(tiny_model_dir, tmp_path, monkeypatch):
    block_network(monkeypatch)
    src = tmp_path / "fp8"
    quantized(tiny_model_dir("llama"), "static-tensor").save_pretrained(src)
    cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
    before, cache_before = _tree(tmp_path), _listing(cache)
    ct = hf_fp8.export(src, tmp_path / "ct")
    vllm = hf_fp8.export(src, tmp_path / "vllm", "vllm-fp8")
    back = hf_fp8.import_checkpoint(ct, tmp_path / "back")
    hf_fp8.inspect_checkpoint(back)
    after = _tree(tmp_path)
    new = {p for p in after if p not in before or after[p] != before[p]}
    outs = (str(ct), str(vllm), str(back))
    assert new and all(p.startswith(outs) for p in new), sorted(new)
    assert _listing(cache) == cache_before  # no download, no cache entry
