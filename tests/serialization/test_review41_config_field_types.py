"""Reviewer R41 F1: ``"model_type": ["bert"]`` (or an object) in an hf_fp8 checkpoint's
config.json crashed ``export`` and ``inspect`` with ``TypeError: unhashable type: 'list'``
(transformers' conversion mapping, ``vllm_fused``'s family lookup); ``architectures`` given as
an object or a number crashed with ``KeyError: 0`` / ``TypeError``, as a bare string it was
read letter by letter, and a list ``dtype`` with transformers' ``IndexError``. Each is now a
``ValueError`` naming config.json, the field and the type it must have, before anything is
written (export, import, inspect, and the command line's one-line error).

References: the values written into config.json here."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from hf_fp8.cli import main
from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint
from tests.serialization.helpers import quantized

BAD = [
    ("model_type", ["bert"], "model_type", "a string"),
    ("model_type", {"bert": 1}, "model_type", "a string"),
    ("model_type", 3, "model_type", "a string"),
    ("architectures", {"a": 1}, "architectures", "a list of strings"),
    ("architectures", 5, "architectures", "a list of strings"),
    ("architectures", "LlamaForCausalLM", "architectures", "a list of strings"),
    ("architectures", [["LlamaForCausalLM"]], "architectures", "a list of strings"),
    ("dtype", ["float32"], "dtype", "a string"),
    ("torch_dtype", {"float32": 1}, "torch_dtype", "a string"),
]
IDS = [f"{k}={type(v).__name__}" for k, v, *_ in BAD]


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory):
    """An hf_fp8 checkpoint (per-tensor weights: both export formats hold it) and its
    compressed-tensors export."""
    root = tmp_path_factory.mktemp("r41_types")
    model = quantized(tiny_model_dir("llama"), "dynamic-tensor-token")
    model.save_pretrained(root / "fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_checkpoint(model, root / "ct", "compressed-tensors")
    return root


def _damaged(src, dst, key, value):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _check(err: Exception, field: str, kind: str, value) -> None:
    text = str(err)
    assert "config.json" in text and field in text and kind in text, text
    assert repr(value) in text, text  # the value found


@pytest.mark.parametrize(("key", "value", "field", "kind"), BAD, ids=IDS)
def test_export_and_inspect_refuse_a_wrong_type(folders, tmp_path, key, value, field, kind):
    src = _damaged(folders / "fp8", tmp_path / "src", key, value)
    for fmt in ("vllm-fp8", "compressed-tensors"):
        with pytest.raises(ValueError) as err, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_checkpoint(src, tmp_path / fmt, fmt)
        _check(err.value, field, kind, value)
        assert not (tmp_path / fmt).exists()
    with pytest.raises(ValueError) as err:
        inspect_checkpoint(src)
    _check(err.value, field, kind, value)


@pytest.mark.parametrize(
    ("key", "value", "field", "kind"), BAD[:2] + BAD[3:4], ids=IDS[:2] + IDS[3:4]
)
def test_import_refuses_a_wrong_type(folders, tmp_path, key, value, field, kind):
    src = _damaged(folders / "ct", tmp_path / "src", key, value)
    with pytest.raises(ValueError) as err:
        import_checkpoint(src, tmp_path / "out")
    _check(err.value, field, kind, value)
    assert not (tmp_path / "out").exists()


def test_command_line_error_is_one_line(folders, tmp_path, capsys):
    src = _damaged(folders / "fp8", tmp_path / "src", "model_type", ["bert"])
    capsys.readouterr()
    assert main(["export", str(src), "--out", str(tmp_path / "out")]) == 1
    assert main(["inspect", str(src)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert "config.json" in line and "model_type" in line and "a string" in line, line
        assert "unhashable" not in line and "TypeError" not in line, line
    assert not (tmp_path / "out").exists()


def test_valid_types_still_work(folders, tmp_path):
    """``torch_dtype: null`` without ``dtype`` is valid (older transformers wrote it): the
    compute dtype is read from the tensors."""
    src = _damaged(folders / "fp8", tmp_path / "src", "torch_dtype", None)
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    (src / "config.json").write_text(json.dumps(config))
    summary = inspect_checkpoint(src)
    assert summary.architecture == "LlamaForCausalLM" and summary.scheme is not None
    assert summary.compute_dtype == "float32"  # the tiny model's tensors
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_checkpoint(src, tmp_path / "ct", "compressed-tensors")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
