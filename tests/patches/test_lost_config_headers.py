"""Hostile safetensors headers neither escape the header reader nor switch the
fp8_without_config check off (R3 finding 3).

Before: a deeply nested header raised RecursionError out of ``tensor_dtypes``; the patch took
it for its own failure and switched itself off for the process, so a later FP8 folder without
``quantization_config`` loaded as garbage. A 21 MB header of ``[]`` cost +532 MB of Python
objects. Now safetensors parses the header (as the load that follows does): such headers are
"not checkable" (``None``) and safetensors refuses them on load anyway. The Python side builds
nothing from them (``tracemalloc``); safetensors' own parse of the ``[]`` flood still peaks
at about +234 MB RSS in Rust, the same as the load transformers runs next.
"""

from __future__ import annotations

import json
import shutil
import struct
import tracemalloc

import pytest
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM

from hf_fp8 import patches
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.utils.safetensors_header import tensor_dtypes
from tests.patches.test_fp8_without_config import _without_config, fp8_dir  # noqa: F401

HOSTILE = {
    "deep": b"[" * 200_000,
    "deep_in_dict": b'{"a":' + b"{" * 100_000,
    "empty_lists": b'{"a":[' + b"[]," * 700_000 + b"[]]}",
    "nested_shape": b'{"w":{"dtype":"F8_E4M3","shape":[[[]]],"data_offsets":[0,1]}}',
}


def _write(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_headers_are_not_checkable_and_safetensors_refuses_them(tmp_path, name):
    path = tmp_path / "model.safetensors"
    _write(path, HOSTILE[name])
    tracemalloc.start()
    try:
        assert tensor_dtypes(path) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(HOSTILE[name]) + 1_000_000, peak
    with pytest.raises(SafetensorError), safe_open(path, "pt"):
        pass


def test_a_header_longer_than_the_file_is_not_read(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 99_000_000) + b"{}" * 4)
    tracemalloc.start()
    try:
        assert tensor_dtypes(path) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak


def test_extra_fields_safetensors_accepts_are_read(tmp_path):
    """safetensors ignores unknown fields of a tensor entry: the dtypes are still read."""
    path = tmp_path / "model.safetensors"
    header = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": [[1], {"a": 2}]}}
    _write(path, json.dumps(header).encode(), b"\0" * 4)
    with safe_open(path, "pt") as f:
        assert list(f.keys()) == ["w"]
    assert tensor_dtypes(path) == {"w": "F32"}


def test_a_hostile_file_does_not_switch_the_check_off(
    fp8_dir,  # noqa: F811
    tiny_model_dir,
    tmp_path,
    monkeypatch,
):
    from hf_fp8.patches import fp8_without_config

    monkeypatch.setattr(fp8_without_config, "_FAILED", [])
    monkeypatch.setattr(patches, "_STATUS", {})
    bad = tmp_path / "hostile"
    bad.mkdir()
    shutil.copy(f"{tiny_model_dir('llama')}/config.json", bad)
    _write(bad / "model.safetensors", HOSTILE["deep"])
    with pytest.raises(Exception) as err:  # safetensors' (or transformers') own error
        AutoModelForCausalLM.from_pretrained(bad)
    assert not isinstance(err.value, RecursionError | CheckpointTensorError)
    assert patches.status()["fp8_without_config"] == "on"
    with pytest.raises(CheckpointTensorError, match="weight_scale"):
        AutoModelForCausalLM.from_pretrained(_without_config(fp8_dir, tmp_path / "ckpt"))
