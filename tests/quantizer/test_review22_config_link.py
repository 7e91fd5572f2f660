"""A pre-quantized ``from_pretrained`` of a folder whose ``config.json`` (or
``generation_config.json``) is a symlink out of it (reviewer R22 F5). It loaded, reading the
config (quantization_config included) from outside the folder, while ``hf-fp8 inspect``
refuses the folder (DESIGN §8: symlinks are not followed). Now refused before the weights
load, as a linked weights file is; a Hub cache snapshot's links into its own ``blobs/`` still
load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fp8.utils.folders import UnsafePathError, check_source_folder

Q = "model.layers.0.self_attn.q_proj"


def _linked(fp8_dir: Path, tmp_path: Path, name: str, folder: Path | None = None) -> Path:
    """A copy of ``fp8_dir`` (at ``folder``) whose ``name`` is a symlink to a file outside."""
    folder = folder or tmp_path / "m"
    shutil.copytree(fp8_dir, folder)
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    source = folder / name
    if not source.exists():
        source.write_text('{"do_sample": false}')
    shutil.move(source, outside / name)
    os.symlink(outside / name, folder / name)
    return folder


def test_linked_config_json_is_refused(llama_fp8_dir, tmp_path, monkeypatch):
    folder = _linked(Path(llama_fp8_dir), tmp_path, "config.json")
    with pytest.raises(UnsafePathError, match="is a symlink") as cli:
        check_source_folder(folder)  # what hf-fp8 inspect / export refuse
    assert "config.json" in str(cli.value)
    # refused before any weight is read: the safetensors loader is never opened
    import transformers.modeling_utils as mu

    def no_weights(*args, **kwargs):
        raise AssertionError("weights read before the config.json link was refused")

    monkeypatch.setattr(mu, "safe_open", no_weights)
    with pytest.raises(UnsafePathError, match=r"config\.json is a symlink") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "replace it with the file itself" in str(err.value)


def test_linked_config_json_of_a_subfolder_is_refused(llama_fp8_dir, tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _linked(Path(llama_fp8_dir), tmp_path, "config.json", folder=root / "fp8")
    with pytest.raises(UnsafePathError, match=r"fp8/config\.json is a symlink"):
        AutoModelForCausalLM.from_pretrained(root, subfolder="fp8")


def test_linked_generation_config_is_refused(llama_fp8_dir, tmp_path):
    folder = _linked(Path(llama_fp8_dir), tmp_path, "generation_config.json")
    with pytest.raises(UnsafePathError, match=r"generation_config\.json is a symlink"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_hub_cache_snapshot_config_link_into_blobs_still_loads(llama_fp8_dir, tmp_path):
    from tests.hub.fake_hub import cache_folder, repo_folder

    commit = cache_folder(tmp_path, "org/fp8", Path(llama_fp8_dir))
    snapshot = repo_folder(tmp_path, "org/fp8") / "snapshots" / commit
    assert (snapshot / "config.json").is_symlink()
    reference = AutoModelForCausalLM.from_pretrained(llama_fp8_dir)
    model = AutoModelForCausalLM.from_pretrained(snapshot)
    assert torch.equal(model.get_submodule(Q).weight_scale, reference.get_submodule(Q).weight_scale)
