"""An FP8 ``pytorch_model.bin`` that lost its quantization_config is refused (reviewer R7
finding 2), and hostile ``.bin`` files cost the check nothing unsafe or unbounded.

Before: the patch read safetensors headers only. ``torch.save`` of an FP8 state dict (fp8
weights + ``weight_scale``) as ``pytorch_model.bin``, config without ``quantization_config``,
loaded silently wrong (logits 1.43 off relative), sharded, in a ``subfolder=`` or as a
``variant=`` alike. Now the pickle of a zip-format file is read with
``torch.load(map_location="meta", weights_only=True)`` (no tensor data) when it is at most
``MAX_PICKLE_BYTES``. The legacy non-zip format is not read: torch cannot load fp8 from it.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from hf_fp8 import patches
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.utils import torch_checkpoint_header
from hf_fp8.utils.torch_checkpoint_header import tensor_dtypes
from tests.tiny_models import model_inputs, model_output


def _fp8_weight_in(file: str) -> str:
    """The refusal names an fp8 weight of ``file``."""
    return rf"^model\.layers\.\d\.[\w.]+\.weight in .*{re.escape(file)} is FP8 \(F8_E4M3\)"


def _bin_folder(src: Path, dst: Path, *, keep_config: bool = False, name="pytorch_model.bin"):
    """``src``'s config (without its quantization_config unless ``keep_config``) and its
    safetensors tensors ``torch.save``d as ``dst/name``."""
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    if not keep_config:
        config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    torch.save(tensors, dst / name)
    return dst, tensors


def _rel(out, ref) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def test_fp8_bin_without_quantization_config_is_refused(llama_fp8_dir, tmp_path):
    folder, _ = _bin_folder(llama_fp8_dir, tmp_path / "bin")
    with pytest.raises(CheckpointTensorError, match=_fp8_weight_in("/pytorch_model.bin")):
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(CheckpointTensorError, match=r"quant_method='fp8', which quantizes"):
        AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=FineGrainedFP8Config(dequantize=True)
        )


def test_sharded_bin_with_the_scale_in_another_shard_is_refused(llama_fp8_dir, tmp_path):
    folder, tensors = _bin_folder(llama_fp8_dir, tmp_path / "sharded")
    (folder / "pytorch_model.bin").unlink()
    scales = {k for k in tensors if k.endswith("weight_scale")}
    parts = {
        "pytorch_model-00001-of-00002.bin": {k: v for k, v in tensors.items() if k not in scales},
        "pytorch_model-00002-of-00002.bin": {k: tensors[k] for k in scales},
    }
    weight_map = {}
    for file, part in parts.items():
        torch.save(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointTensorError, match=_fp8_weight_in("/pytorch_model-00001-of-00002.bin")
    ):
        AutoModelForCausalLM.from_pretrained(folder)


def test_fp8_bin_in_a_subfolder_or_as_a_variant_is_refused(llama_fp8_dir, tmp_path):
    _bin_folder(llama_fp8_dir, tmp_path / "repo" / "sub")
    with pytest.raises(CheckpointTensorError, match=_fp8_weight_in("/sub/pytorch_model.bin")):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub")
    variant, _ = _bin_folder(llama_fp8_dir, tmp_path / "variant", name="pytorch_model.fp8.bin")
    with pytest.raises(CheckpointTensorError, match=_fp8_weight_in("/pytorch_model.fp8.bin")):
        AutoModelForCausalLM.from_pretrained(variant, variant="fp8")


def test_bins_that_carry_their_config_or_no_fp8_load(llama_fp8_dir, tiny_model_dir, tmp_path):
    """A float ``.bin`` loads its tensors; an hf_fp8 ``.bin`` with its quantization_config
    reproduces the safetensors FP8 model."""
    inputs = model_inputs("llama")
    plain, tensors = _bin_folder(Path(tiny_model_dir("llama")), tmp_path / "plain")
    model = AutoModelForCausalLM.from_pretrained(plain)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.get_submodule(key.rpartition(".")[0]).weight, tensors[key])
    own, _ = _bin_folder(llama_fp8_dir, tmp_path / "own", keep_config=True)
    reference = model_output(AutoModelForCausalLM.from_pretrained(llama_fp8_dir), inputs)
    out = model_output(AutoModelForCausalLM.from_pretrained(own), inputs)
    assert _rel(out, reference) < 1e-6


def _zip_checkpoint(path: Path, data_pkl: bytes) -> Path:
    """A zip laid out like ``torch.save``'s, with the given ``data.pkl``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return path


class _Mkdir:
    """Unpickling this would create a folder (code run by a pickle)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return (os.mkdir, (str(self.path),))


def test_hostile_bins_are_not_checked_and_run_nothing(tmp_path, monkeypatch):
    """A legacy (non-zip) file, garbage, a pickle that would run code, a pickle that is not a
    state dict, a torch file holding a non-tensor: ``None`` (unchecked), nothing executed."""
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    (tmp_path / "garbage.bin").write_bytes(b"PK\x03\x04" + b"\xff" * 100)
    marker = tmp_path / "pwned"
    _zip_checkpoint(tmp_path / "code.bin", pickle.dumps(_Mkdir(marker), protocol=2))
    _zip_checkpoint(tmp_path / "list.bin", pickle.dumps([1, 2, 3], protocol=2))
    torch.save({"w": torch.ones(2), "n": 3}, tmp_path / "mixed.bin")
    for name in ("legacy.bin", "garbage.bin", "code.bin", "list.bin", "missing.bin"):
        assert tensor_dtypes(tmp_path / name) is None, name
    assert not marker.exists()
    assert tensor_dtypes(tmp_path / "mixed.bin") == {"w": "F32"}


def test_a_pickle_over_the_limit_is_never_unpickled(tmp_path, monkeypatch):
    path = tmp_path / "big.bin"
    torch.save({f"t{i}": torch.ones(1) for i in range(100)}, path)
    size = torch._C.PyTorchFileReader(str(path)).get_record_size("data.pkl")

    calls = []
    monkeypatch.setattr(torch_checkpoint_header, "MAX_PICKLE_BYTES", size - 1)
    monkeypatch.setattr(torch_checkpoint_header.torch, "load", lambda *a, **k: calls.append(a))
    assert tensor_dtypes(path) is None
    assert calls == []  # never unpickled


def test_a_large_record_torch_load_reads_whole_is_never_read(tmp_path, monkeypatch):
    """``torch.load`` reads ``byteorder`` (and two more records) whole: a hostile one of
    megabytes is not read by the check."""
    path = tmp_path / "byteorder.bin"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        z.writestr("archive/byteorder", "little" * 2**20)
        z.writestr("archive/version", "3\n")

    calls = []
    monkeypatch.setattr(torch_checkpoint_header.torch, "load", lambda *a, **k: calls.append(a))
    assert tensor_dtypes(path) is None
    assert calls == []  # never unpickled


def test_a_hostile_bin_fails_the_load_as_transformers_alone_would(tiny_model_dir, tmp_path):
    """The check skips it and stays on; transformers' own torch.load refuses the file."""
    folder = tmp_path / "hostile"
    folder.mkdir()
    shutil.copy(Path(tiny_model_dir("llama")) / "config.json", folder)
    marker = tmp_path / "pwned"
    _zip_checkpoint(folder / "pytorch_model.bin", pickle.dumps(_Mkdir(marker), protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        AutoModelForCausalLM.from_pretrained(folder)
    assert not marker.exists()
    assert patches.status()["fp8_without_config"] == "on"


def test_a_legacy_fp8_bin_cannot_load_at_all(llama_fp8_dir, tmp_path):
    """Why the legacy format is not read: torch cannot load fp8 tensors from it, so the load
    fails instead of loading wrong."""
    folder, tensors = _bin_folder(llama_fp8_dir, tmp_path / "legacy")
    torch.save(tensors, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(AttributeError, match="UntypedStorage"):
        AutoModelForCausalLM.from_pretrained(folder)
