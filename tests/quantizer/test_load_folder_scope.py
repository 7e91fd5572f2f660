"""What a pre-quantized ``from_pretrained`` checks is what transformers reads (reviewer R3
findings 2 and 3b): the folder it loads (``root/subfolder``), the index it reads and the
checkpoint files that index names. Before, the whole tree of ``config.name_or_path`` was
walked: the root's own incomplete index refused ``subfolder=`` loads, any unrelated symlink
(``logs/latest``, a linked tokenizer file) refused the load, and a stale, deeply nested
``pytorch_model.bin.index.json`` raised ``RecursionError``. ``hf-fp8 inspect`` / ``export``
(``check_source_folder``, which copy the whole folder) keep the strict whole-folder rule."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fp8.utils import folders
from hf_fp8.utils.folders import UnsafePathError, check_source_folder

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def fp8_dir(llama_fp8_dir) -> Path:
    return llama_fp8_dir


@pytest.fixture(scope="module")
def reference(fp8_dir):
    return AutoModelForCausalLM.from_pretrained(fp8_dir).get_submodule(Q)


def _same(model, reference) -> bool:
    """The loaded layer ``Q`` has the reference's fp8 bytes and scale."""
    layer = model.get_submodule(Q)
    return torch.equal(
        layer.weight.view(torch.uint8), reference.weight.view(torch.uint8)
    ) and torch.equal(layer.weight_scale, reference.weight_scale)


def test_subfolder_load_ignores_the_roots_incomplete_index(fp8_dir, reference, tmp_path):
    """``snapshot_download(allow_patterns=["*.json", "fp8/*"])``: the root's own shards are
    absent; transformers reads ``root/fp8`` only."""
    root = tmp_path / "repo"
    shutil.copytree(fp8_dir, root / "fp8")
    shutil.copy(fp8_dir / "config.json", root / "config.json")
    stale = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(stale))
    assert _same(AutoModelForCausalLM.from_pretrained(root, subfolder="fp8"), reference)


def test_unrelated_symlinks_do_not_block_a_load(fp8_dir, reference, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(fp8_dir, folder)
    (folder / "logs" / "run1").mkdir(parents=True)
    os.symlink("run1", folder / "logs" / "latest")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "tokenizer.json").write_text("{}")
    os.symlink(tmp_path / "base" / "tokenizer.json", folder / "tokenizer.json")
    assert _same(AutoModelForCausalLM.from_pretrained(folder), reference)
    with pytest.raises(UnsafePathError, match="is a symlink"):  # the CLI copies every file
        check_source_folder(folder)


def test_symlinked_subfolder_is_refused(fp8_dir, tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(fp8_dir / "config.json", root / "config.json")
    shutil.copytree(fp8_dir, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / "fp8")
    with pytest.raises(UnsafePathError, match=r"fp8 is a symlink"):
        AutoModelForCausalLM.from_pretrained(root, subfolder="fp8")


def _sharded(fp8_dir: Path, folder: Path) -> Path:
    """``fp8_dir`` saved again in several shards."""
    AutoModelForCausalLM.from_pretrained(fp8_dir).save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def test_symlinked_index_is_refused(fp8_dir, tmp_path):
    folder = _sharded(fp8_dir, tmp_path / "m")
    index = folder / "model.safetensors.index.json"
    shutil.move(index, tmp_path / "index.json")
    os.symlink(tmp_path / "index.json", index)
    with pytest.raises(UnsafePathError, match=r"model\.safetensors\.index\.json is a symlink"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_missing_shard_of_the_read_index_names_it(fp8_dir, tmp_path):
    folder = _sharded(fp8_dir, tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard.name}.*incomplete"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_nested_stale_index_is_not_parsed(fp8_dir, reference, tmp_path):
    """A ``pytorch_model.bin.index.json`` next to ``model.safetensors`` is never read by
    transformers: its content (here nested past Python's recursion limit) does not matter,
    for the load and for the CLI's rule (a stale index that does not parse is ignored)."""
    folder = tmp_path / "m"
    shutil.copytree(fp8_dir, folder)
    (folder / "pytorch_model.bin.index.json").write_text("[" * 100_000)
    assert _same(AutoModelForCausalLM.from_pretrained(folder), reference)
    check_source_folder(folder)


def test_cli_read_index_that_does_not_parse_names_the_file(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*RecursionError"):
        check_source_folder(tmp_path)


def test_cli_oversized_index_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(folders, "MAX_INDEX_BYTES", 1000)
    index = {"metadata": {}, "weight_map": {f"t{i}": "model.safetensors" for i in range(100)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is \d+ bytes"):
        check_source_folder(tmp_path)
