"""``from_pretrained`` of a pre-quantized hf_fp8 folder reads only the folder's own files
(DESIGN §8; reviewer R2 F4): an index entry with ``..`` or an absolute path, and a symlinked
shard, are refused as ``hf-fp8 inspect`` refuses them. Before, transformers followed all three
and loaded tensors from outside the folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fp8.serialization.atomic import UnsafePathError


@pytest.fixture(scope="module")
def fp8_dir(llama_fp8_dir) -> Path:
    return llama_fp8_dir


def _split_outside(fp8_dir: Path, tmp_path: Path, target: str | None) -> Path:
    """A copy of ``fp8_dir`` sharded in two, the second shard in ``outside/``, named in the
    index by ``target`` (``None``: its absolute path)."""
    folder, outside = tmp_path / "m", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    shutil.copy(fp8_dir / "config.json", folder / "config.json")
    tensors = load_file(fp8_dir / "model.safetensors")
    keys = sorted(tensors)
    first, second = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    save_file({k: tensors[k] for k in first}, folder / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in second}, outside / "evil.safetensors")
    name = target if target is not None else str(outside / "evil.safetensors")
    weight_map = dict.fromkeys(first, "model-00001-of-00002.safetensors") | dict.fromkeys(
        second, name
    )
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize(
    ("target", "pattern"),
    [("../outside/evil.safetensors", "leaves the folder"), (None, "absolute path")],
)
def test_index_entries_outside_the_folder_are_refused(fp8_dir, tmp_path, target, pattern):
    folder = _split_outside(fp8_dir, tmp_path, target)
    with pytest.raises(UnsafePathError, match=rf"evil\.safetensors.*{pattern}|{pattern}"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_symlinked_weights_are_refused(fp8_dir, tmp_path):
    folder, outside = tmp_path / "m", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    shutil.copy(fp8_dir / "config.json", folder / "config.json")
    shutil.copy(fp8_dir / "model.safetensors", outside / "full.safetensors")
    os.symlink(outside / "full.safetensors", folder / "model.safetensors")
    with pytest.raises(UnsafePathError, match=r"model\.safetensors is a symlink"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_stale_indexes_transformers_ignores_still_load(fp8_dir, tmp_path):
    """The previous session's rule: an index transformers does not read (next to
    ``model.safetensors``; a ``.bin`` index whose shards were not downloaded) may name files
    that are gone; it is not refused."""
    folder = tmp_path / "m"
    shutil.copytree(fp8_dir, folder)
    stale = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(stale))
    stale_bin = {"metadata": {}, "weight_map": {"lm_head.weight": "pytorch_model-1.bin"}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(stale_bin))
    reference = AutoModelForCausalLM.from_pretrained(fp8_dir)
    model = AutoModelForCausalLM.from_pretrained(folder)
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(
        model.get_submodule(q).weight.view(torch.uint8),
        reference.get_submodule(q).weight.view(torch.uint8),
    )


def test_subfolder_weights_outside_the_folder_are_refused(fp8_dir, tmp_path):
    """``from_pretrained(root, subfolder=...)`` reads ``root/sub``: its index is held to the
    same rules."""
    folder = _split_outside(fp8_dir, tmp_path, "../../outside/evil.safetensors")
    root = tmp_path / "root"
    root.mkdir()
    shutil.move(folder, root / "m")  # root/m/../../outside is tmp_path/outside
    with pytest.raises(UnsafePathError, match=r"outside the folder|leaves the folder"):
        AutoModelForCausalLM.from_pretrained(root, subfolder="m")


def test_hub_cache_snapshot_links_into_blobs_still_load(fp8_dir, tmp_path):
    """A Hub cache snapshot's files are links into the repo's ``blobs/``: the cache's layout,
    allowed (as ``hf-fp8 inspect`` allows it)."""
    from tests.hub.fake_hub import cache_folder, repo_folder

    commit = cache_folder(tmp_path, "org/fp8", fp8_dir)
    snapshot = repo_folder(tmp_path, "org/fp8") / "snapshots" / commit
    assert (snapshot / "model.safetensors").is_symlink()
    reference = AutoModelForCausalLM.from_pretrained(fp8_dir)
    model = AutoModelForCausalLM.from_pretrained(snapshot)
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(model.get_submodule(q).weight_scale, reference.get_submodule(q).weight_scale)
