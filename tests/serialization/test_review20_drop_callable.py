"""Reviewer 20 (F1): ``atomic_folder(drop=callable)`` decides what to drop from what the block
wrote; the weight patterns of a save never name ``.bin`` files or another variant."""

from __future__ import annotations

import pytest

from hf_fp8.hub.hooks import stale_weights
from hf_fp8.serialization.atomic import atomic_folder


def _tree(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


_OLD = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model.v1.safetensors",
    "model.safetensors.index.v1.json",
    "model.v1-00001-of-00002.safetensors",
    "pytorch_model.bin",
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model.bin.index.json",
    "model-final.safetensors",  # a user's file, not a shard name
)


@pytest.fixture
def dest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in _OLD:
        (out / name).write_text("old")
    return out


@pytest.mark.parametrize("mode", ["swap", "in-folder"])
def test_main_weights_written_drop_only_the_main_set(dest, monkeypatch, mode):
    if mode == "in-folder":
        monkeypatch.chdir(dest)
    with atomic_folder(dest, drop=stale_weights(None)) as tmp:
        (tmp / "model.safetensors").write_text("new")
    expected = set(_OLD) - {"model.safetensors.index.json", "model-00001-of-00002.safetensors"}
    assert set(_tree(dest)) == expected
    assert (dest / "model.safetensors").read_text() == "new"


def test_variant_written_drops_only_that_variant(dest):
    with atomic_folder(dest, drop=stale_weights("v1")) as tmp:
        (tmp / "model.v1.safetensors").write_text("new")
    expected = set(_OLD) - {
        "model.safetensors.index.v1.json",
        "model.v1-00001-of-00002.safetensors",
    }
    assert set(_tree(dest)) == expected


def test_no_weights_written_drops_nothing(dest):
    with atomic_folder(dest, drop=stale_weights(None)) as tmp:
        (tmp / "adapter_model.safetensors").write_text("lora")
    assert set(_tree(dest)) == {*_OLD, "adapter_model.safetensors"}


def test_drop_callable_sees_what_the_block_wrote(dest):
    seen = []

    def drop(tmp):
        seen.append(sorted(p.name for p in tmp.iterdir()))
        return ["pytorch_model.bin"]

    with atomic_folder(dest, drop=drop) as tmp:
        (tmp / "x.txt").write_text("x")
        assert seen == []  # called after the block, not before
    assert seen == [["x.txt"]]
    assert "pytorch_model.bin" not in _tree(dest)


def test_variant_with_glob_characters_is_literal(dest):
    (dest / "model.v[1].safetensors").write_text("old")
    with atomic_folder(dest, drop=stale_weights("v?")) as tmp:
        (tmp / "model.v?.safetensors").write_text("new")
    assert "model.v1.safetensors" in _tree(dest)  # '?' matched nothing but itself
    assert "model.v[1].safetensors" in _tree(dest)
