"""A damaged ``pytorch_model.bin`` leaves the lost-config check on (reviewer R9 findings 2, 3).

Before: 1 in 306 byte-flipped ``torch.save`` files made ``torch._C.PyTorchFileReader`` raise
``UnicodeDecodeError`` (its error message names a record whose name is not UTF-8); the header
reader let it out, the patch took it for its own failure and switched itself off for the
process: the next FP8 folder without its quantization_config loaded silently wrong (logits
1.31 off). And the reader's constructor read the zip's ``version`` record whole before any size
was checked: a 390 kB file with a deflated 400 MB ``version`` cost the check 3.5 s.
"""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fp8 import patches
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.utils import torch_checkpoint_header
from hf_fp8.utils.torch_checkpoint_header import tensor_dtypes

_CENTRAL_ENTRY = b"PK\x01\x02"
_CENTRAL_NAME_AT = 46  # the file name's offset in a central directory entry


def _damaged_bin(path: Path) -> Path:
    """A ``torch.save`` file whose first central-directory name (``archive/data.pkl``) has its
    ``/`` flipped to ``\\xf9`` (the byte the reviewer's seeded fuzzer flipped)."""
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    raw = bytearray(buffer.getvalue())
    name_at = raw.index(_CENTRAL_ENTRY) + _CENTRAL_NAME_AT
    slash = raw.index(b"/", name_at)
    raw[slash] = 0xF9
    path.write_bytes(bytes(raw))
    return path


def test_a_damaged_bin_that_torch_reads_with_a_unicode_error_is_unchecked(tmp_path):
    path = _damaged_bin(tmp_path / "damaged.bin")
    with pytest.raises(UnicodeDecodeError):  # what the reader itself raises on this file
        torch._C.PyTorchFileReader(str(path))
    assert tensor_dtypes(path) is None


@pytest.mark.parametrize(
    "error", [UnicodeDecodeError("utf-8", b"\xf9", 0, 1, "bad"), ValueError("odd"), KeyError(1)]
)
def test_any_error_reading_a_bin_is_unchecked(tmp_path, monkeypatch, error):
    """Whatever torch's reader raises on a damaged file, the file is "unchecked"."""
    path = tmp_path / "w.bin"
    torch.save({"w": torch.ones(2)}, path)

    def reader(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch_checkpoint_header.torch._C, "PyTorchFileReader", reader)
    assert tensor_dtypes(path) is None


def test_a_damaged_bin_does_not_switch_the_check_off(llama_fp8_dir, tiny_model_dir, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    shutil.copy(Path(tiny_model_dir("llama")) / "config.json", damaged)
    _damaged_bin(damaged / "pytorch_model.bin")
    with pytest.raises(Exception):  # noqa: B017 - transformers' own error, whichever
        AutoModelForCausalLM.from_pretrained(damaged)
    assert patches.status()["fp8_without_config"] == "on"
    lost = tmp_path / "lost"
    shutil.copytree(llama_fp8_dir, lost)
    config = json.loads((lost / "config.json").read_text())
    del config["quantization_config"]
    (lost / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointTensorError, match=r"F8_E4M3"):
        AutoModelForCausalLM.from_pretrained(lost)


def _with_record(path: Path, record: str, data: bytes) -> Path:
    """A ``torch.save`` file re-zipped with ``record`` replaced by ``data``, deflated."""
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            if info.filename.partition("/")[2] == record:
                out.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED)
            else:
                out.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_STORED)
    return path


@pytest.mark.parametrize("record", ["version", ".data/serialization_id", "data.pkl"])
def test_a_large_record_the_reader_reads_whole_is_never_read(tmp_path, monkeypatch, record):
    """A deflated 16 MB record in a file of kilobytes: torch's reader is never constructed."""
    path = _with_record(tmp_path / "big.bin", record, b"0" * (16 * 2**20) + b"3\n")
    assert path.stat().st_size < 100_000
    built = []
    real = torch._C.PyTorchFileReader

    def reader(*args, **kwargs):
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_checkpoint_header.torch._C, "PyTorchFileReader", reader)
    assert tensor_dtypes(path) is None
    assert built == []


def test_a_deflated_bin_with_small_records_is_checked(tmp_path):
    """Small deflated records (a re-zipped checkpoint) are read as before."""
    path = _with_record(tmp_path / "deflated.bin", "version", b"3\n")
    assert tensor_dtypes(path) == {"w": "F32"}


def test_a_record_named_in_another_case_counts(tmp_path):
    """torch's reader finds records ignoring ASCII case: ``VERSION`` is ``version``."""
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    path = tmp_path / "case.bin"
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info))
        out.writestr("archive/VERSION", b"0" * 2**20, compress_type=zipfile.ZIP_DEFLATED)
    assert tensor_dtypes(path) is None


@pytest.mark.parametrize(
    "error", [UnicodeDecodeError("utf-8", b"\xf9", 0, 1, "bad"), ValueError("x")]
)
def test_an_error_reading_a_safetensors_file_is_unchecked(tmp_path, monkeypatch, error):
    """The same for safetensors headers: an error reading the file is not the check's own."""
    from safetensors.torch import save_file

    from hf_fp8.utils import safetensors_header

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, path)

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(safetensors_header, "safe_open", broken)
    assert safetensors_header.tensor_dtypes(path) is None
