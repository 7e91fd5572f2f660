"""``tensor_dtypes`` reads the dtypes safetensors itself reports, and gives ``None`` (never
raises) for a file that is not safetensors."""

from __future__ import annotations

import struct

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_fp8.utils.safetensors_header import MAX_HEADER_BYTES, tensor_dtypes


def test_dtypes_match_safe_open(tmp_path):
    path = tmp_path / "m.safetensors"
    tensors = {
        "a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn),
        "a.weight_scale": torch.ones(4, 1),
        "b.weight": torch.zeros(2, dtype=torch.float8_e5m2),
        "c": torch.zeros(3, dtype=torch.bfloat16),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    with safe_open(path, "pt") as f:
        expected = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert tensor_dtypes(path) == expected
    assert expected["a.weight"] == "F8_E4M3" and expected["b.weight"] == "F8_E5M2"


def test_unreadable_files_give_none(tmp_path):
    cases = {
        "short": b"\x01\x02",
        "huge_header": struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",
        "not_json": struct.pack("<Q", 3) + b"abc",
        "not_a_dict": struct.pack("<Q", 2) + b"[]",
    }
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw)
        assert tensor_dtypes(tmp_path / name) is None, name
    assert tensor_dtypes(tmp_path / "missing") is None
