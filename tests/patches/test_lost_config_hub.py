"""An FP8 checkpoint without quantization_config from the Hub cache is refused (R3 finding 1).

Before: a snapshot folder (its files are links into ``blobs/``) and a Hub id resolved from
the cache (``HF_HUB_OFFLINE=1``) were not checked (the files' real paths lie outside the
snapshot; a Hub id is no folder): the fp8 codes loaded into ``nn.Linear`` silently.
"""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
from transformers import AutoModelForCausalLM

from hf_fp8.numerics.checks import CheckpointTensorError
from tests.hub.fake_hub import write_snapshot
from tests.patches.test_fp8_without_config import fp8_dir  # noqa: F401 (fixture)

REPO = "hf-fp8-tests/fp8-lost-config"


def _files_without_config(folder: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    config = json.loads(files["config.json"])
    del config["quantization_config"]
    files["config.json"] = json.dumps(config).encode()
    return files


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_snapshot_folder_without_quantization_config_is_refused(fp8_dir, hub_cache):  # noqa: F811
    commit = write_snapshot(hub_cache, REPO, _files_without_config(fp8_dir))
    snapshot = hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    assert (snapshot / "model.safetensors").is_symlink()
    with pytest.raises(CheckpointTensorError, match=r"weight in .*snapshots.*\(F8_E4M3\)"):
        AutoModelForCausalLM.from_pretrained(snapshot)


def test_hub_id_without_quantization_config_is_refused(fp8_dir, hub_cache):  # noqa: F811
    write_snapshot(hub_cache, REPO, _files_without_config(fp8_dir))
    with pytest.raises(CheckpointTensorError, match=r"weight_scale") as err:
        AutoModelForCausalLM.from_pretrained(REPO)
    assert REPO in str(err.value)


def test_hub_id_with_its_quantization_config_loads(fp8_dir, hub_cache):  # noqa: F811
    files = {p.name: p.read_bytes() for p in sorted(fp8_dir.iterdir()) if p.is_file()}
    write_snapshot(hub_cache, REPO, files)
    model = AutoModelForCausalLM.from_pretrained(REPO)
    assert model.hf_quantizer is not None and model.hf_quantizer.pre_quantized
