"""``check_loaded_files`` (a pre-quantized ``from_pretrained``'s folder rule) refuses a linked
``config.json`` / ``generation_config.json`` of the folder read (reviewer R22 F5), in a
subfolder too; a Hub cache snapshot's links into its own ``blobs/`` stay allowed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hf_fp8.utils.folders import UnsafePathError, check_loaded_files


def _folder(tmp_path: Path, sub: str = "") -> Path:
    folder = tmp_path / "m" / sub
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("sub", ["", "fp8"])
def test_linked_config_files_of_the_folder_read_are_refused(tmp_path, name, sub):
    folder = _folder(tmp_path, sub)
    (tmp_path / "outside.json").write_text("{}")
    (folder / name).unlink(missing_ok=True)
    os.symlink(tmp_path / "outside.json", folder / name)
    root = tmp_path / "m"
    files = [os.path.join(str(root), sub, "model.safetensors")]
    with pytest.raises(UnsafePathError, match=rf"{os.path.join(sub, name)} is a symlink"):
        check_loaded_files(str(root), files)
    with pytest.raises(UnsafePathError, match="is a symlink"):  # no weights resolved
        check_loaded_files(str(folder), [])


def test_plain_config_files_pass(tmp_path):
    folder = _folder(tmp_path)
    (folder / "generation_config.json").write_text("{}")
    files = [str(folder / "model.safetensors")]
    assert check_loaded_files(str(folder), files) == str(folder)


def test_hub_cache_snapshot_links_into_blobs_pass(tmp_path):
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        (repo / "blobs" / name).write_text("{}")
        os.symlink(os.path.relpath(repo / "blobs" / name, snapshot), snapshot / name)
    files = [str(snapshot / "model.safetensors")]
    assert check_loaded_files(str(snapshot), files) == str(snapshot)


def test_linked_config_next_to_the_index_of_nested_shards_is_refused(tmp_path):
    """An index in the folder read naming shards in ``shards/``: the config transformers
    read is the index's neighbour, not one in ``shards/``."""
    folder = tmp_path / "m"
    (folder / "shards").mkdir(parents=True)
    names = ["shards/a.safetensors", "shards/b.safetensors"]
    for name in names:
        (folder / name).write_bytes(b"")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (tmp_path / "outside.json").write_text("{}")
    os.symlink(tmp_path / "outside.json", folder / "config.json")
    files = [os.path.join(str(folder), name) for name in names]
    with pytest.raises(UnsafePathError, match=r"m/config\.json is a symlink"):
        check_loaded_files(str(folder), files)
