"""Reviewer R17 finding F4: the converters and ``inspect_checkpoint`` did not apply the lower
bound of static input scales (``min_input_scale``, the one ``Fp8Linear``'s load applies). A
checkpoint with a ``1e-45`` input scale was reported clean by ``inspect_checkpoint``,
imported into a folder that ``from_pretrained`` then refused, and exported to vLLM formats.

Now each route refuses it with ``CheckpointTensorError`` naming the tensor, before writing
anything; the bound itself (what calibration stores for an amax of 1e-12) still passes."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_fp8 import inspect_checkpoint
from hf_fp8.numerics import amax_to_scale
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.serialization import export_checkpoint, import_checkpoint
from tests.serialization.helpers import quantized

FORMATS = ["compressed-tensors", "vllm-fp8"]
TINY = [1e-45, 1e-20, 0.0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    """A calibrated static model saved in hf_fp8's layout and exported to each format."""
    root = tmp_path_factory.mktemp("r17_f4")
    model = quantized(tiny_model_dir("llama"), "static-tensor")
    out = {"hf_fp8": root / "hf_fp8"}
    model.save_pretrained(out["hf_fp8"])
    for fmt in FORMATS:
        out[fmt] = export_checkpoint(model, root / fmt, fmt)
    return out


def _tampered(src, dst, value: float) -> str:
    """A copy of the folder ``src`` at ``dst`` with one input scale set to ``value``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    path = dst / "model.safetensors"
    with safe_open(path, "pt") as h:
        meta = h.metadata()
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if k.endswith("down_proj.input_scale"))
    tensors[key] = torch.full_like(tensors[key], value)
    save_file(tensors, path, metadata=meta)
    return key


@pytest.mark.parametrize("fmt", ["hf_fp8", *FORMATS])
@pytest.mark.parametrize("value", TINY)
def test_inspect_refuses_a_tiny_input_scale_naming_it(folders, fmt, value, tmp_path):
    key = _tampered(folders[fmt], tmp_path / "bad", value)
    with pytest.raises(CheckpointTensorError, match=rf"{key}.*(below|> 0)"):
        inspect_checkpoint(tmp_path / "bad")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("value", TINY)
def test_import_refuses_a_tiny_input_scale_and_writes_nothing(folders, fmt, value, tmp_path):
    key = _tampered(folders[fmt], tmp_path / "bad", value)
    with pytest.raises(CheckpointTensorError, match=rf"{key}.*(below|> 0)"):
        import_checkpoint(tmp_path / "bad", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_refuses_a_tiny_input_scale_and_writes_nothing(folders, fmt, tmp_path):
    key = _tampered(folders["hf_fp8"], tmp_path / "bad", 1e-45)
    with pytest.raises(CheckpointTensorError, match=rf"{key}.*below"):
        export_checkpoint(tmp_path / "bad", tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bound_itself_passes_every_route_unchanged(folders, fmt, tmp_path):
    low = float(amax_to_scale(torch.tensor([1e-12]), torch.float8_e4m3fn))
    key = _tampered(folders["hf_fp8"], tmp_path / "low", low)
    inspect_checkpoint(tmp_path / "low")
    exported = export_checkpoint(tmp_path / "low", tmp_path / "exported", fmt)
    inspect_checkpoint(exported)
    back = import_checkpoint(exported, tmp_path / "back")
    stored = load_file(back / "model.safetensors")[key]
    assert torch.equal(stored, torch.tensor([low]))
