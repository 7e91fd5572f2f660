"""inspect on MoE checkpoints: experts count as FP8 (merged or per expert), the FP8 share of
the parameters, and what stays in high precision with the reason."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from hf_fp8.serialization import import_checkpoint, inspect_checkpoint
from tests.serialization.moe_fixtures import tiny_qwen3_moe, write_fp8_block_checkpoint


def _count(path) -> tuple[int, int]:
    """(fp8 elements, all elements but scales), read from the file."""
    fp8 = total = 0
    with safe_open(path / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118
            t = f.get_tensor(key)
            if "scale" in key.rpartition(".")[2]:
                continue
            total += t.numel()
            fp8 += t.numel() if t.element_size() == 1 else 0
    return fp8, total


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_summary")
    write_fp8_block_checkpoint(tiny_qwen3_moe(), root / "src")
    return root / "src", import_checkpoint(root / "src", root / "hf_fp8")


@pytest.mark.parametrize("which", [0, 1], ids=["per-expert-fp8", "merged-hf_fp8"])
def test_share_and_reasons(folders, which) -> None:
    path = folders[which]
    summary = inspect_checkpoint(path)
    fp8, total = _count(path)
    assert (summary.fp8_parameters, summary.parameters) == (fp8, total)
    assert summary.fp8_share == pytest.approx(fp8 / total)
    assert summary.to_dict()["fp8_share"] == summary.fp8_share
    # experts listed once per merged projection
    assert "model.layers.1.mlp.experts.gate_up_proj" in summary.fp8_layers
    assert len(summary.fp8_layers) == 2 * (4 + 2)
    parts = {p["what"]: p for p in summary.high_precision_parts}
    assert parts["MoE routers"]["parameters"] == 2 * 4 * 128
    assert "pick the experts" in parts["MoE routers"]["why"]
    assert parts["embeddings"]["parameters"] == 128 * 128
    assert sum(p["parameters"] for p in summary.high_precision_parts) == total - fp8
    assert summary.note is None


def test_lm_head_reason_names_the_config(folders) -> None:
    parts = {p["what"]: p for p in inspect_checkpoint(folders[1]).high_precision_parts}
    assert "lm_head" in parts["modules_to_not_convert"]["why"]
