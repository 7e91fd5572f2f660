"""Issue 12 §4: export, import and inspect read and write inside their folders only; config.json
never names code to run; a stale shard index that transformers tolerates is tolerated too."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint
from hf_fp8.serialization.atomic import UnsafePathError
from hf_fp8.serialization.checkpoint import folder_files
from tests.serialization.helpers import quantized


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dir, tmp_path_factory):
    """A sharded hf_fp8 checkpoint (several shards and an index)."""
    out = tmp_path_factory.mktemp("fp8") / "fp8"
    quantized(tiny_model_dir("llama"), "dynamic-row-token").save_pretrained(
        out, max_shard_size="20KB"
    )
    assert (out / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def ct_dir(fp8_dir, tmp_path_factory):
    return export_checkpoint(fp8_dir, tmp_path_factory.mktemp("ct") / "ct")


def _copy_with_shard(src, dst, bad_name):
    """``src`` copied to ``dst`` with its first shard renamed in the index to ``bad_name``."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {
        k: (bad_name if v == first else v) for k, v in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))
    return dst, first


def _op(kind, src, out):
    if kind == "export":
        return export_checkpoint(src, out)
    if kind == "import":
        return import_checkpoint(src, out)
    return inspect_checkpoint(src)


@pytest.mark.parametrize("kind", ["export", "import", "inspect"])
def test_index_entry_outside_the_folder_is_refused(kind, fp8_dir, ct_dir, tmp_path):
    base = tmp_path / "a" / "b"
    base.mkdir(parents=True)
    src, first = _copy_with_shard(
        fp8_dir if kind != "import" else ct_dir, base / "src", "./../../victim.safetensors"
    )
    victim = tmp_path / "a" / "victim.safetensors"
    shutil.copy(src / first, victim)  # a readable file where the entry points
    before = victim.read_bytes()
    out = base / "src" / "sub" / "out"  # ../../victim from out reaches the same file
    with pytest.raises(UnsafePathError, match=r"victim\.safetensors") as err:
        _op(kind, src, out)
    assert "\n" not in str(err.value)
    assert victim.read_bytes() == before
    assert not out.exists() and not (src / "sub").exists()


@pytest.mark.parametrize("kind", ["export", "import", "inspect"])
@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.safetensors"])
def test_absolute_or_parent_entries_are_refused(kind, bad, fp8_dir, ct_dir, tmp_path):
    src, _ = _copy_with_shard(fp8_dir if kind != "import" else ct_dir, tmp_path / "src", bad)
    if bad.startswith(".."):
        shutil.copy(next(src.glob("*.safetensors")), tmp_path / "outside.safetensors")
    with pytest.raises(UnsafePathError, match=r"absolute|leaves the folder"):
        _op(kind, src, tmp_path / "out")


def test_symlinked_files_in_the_source_are_refused(fp8_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    src = tmp_path / "src"
    shutil.copytree(fp8_dir, src)
    (src / "tokenizer.json").symlink_to(secret)
    with pytest.raises(UnsafePathError, match=r"tokenizer\.json is a symlink"):
        export_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsafePathError, match="is a symlink"):
        folder_files(src)  # what push uploads


def test_symlinked_shard_is_refused(fp8_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fp8_dir, src)
    shard = sorted(src.glob("model-*.safetensors"))[0]
    moved = tmp_path / "elsewhere.safetensors"
    shard.rename(moved)
    shard.symlink_to(moved)
    for kind in ("export", "inspect"):
        with pytest.raises(UnsafePathError, match="is a symlink"):
            _op(kind, src, tmp_path / "out")


def test_folder_files_lists_plain_files_only(fp8_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fp8_dir, src)
    (src / ".cache").mkdir()
    (src / ".cache" / "x").write_text("hidden")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text("{}")
    files = folder_files(src)
    assert "1_Pooling/config.json" in files and "config.json" in files
    assert not any(f.startswith(".") for f in files)
    assert set(files) >= {p.name for p in fp8_dir.iterdir()}


def test_inspect_never_calls_what_architectures_names(fp8_dir, tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(transformers, "set_seed", lambda *a, **k: called.append(a))
    src = tmp_path / "src"
    shutil.copytree(fp8_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["set_seed"]
    (src / "config.json").write_text(json.dumps(config))
    summary = inspect_checkpoint(src)
    assert called == []
    assert summary.format == "hf_fp8" and len(summary.fp8_layers) == 14


def test_registered_architecture_is_used(fp8_dir):
    summary = inspect_checkpoint(fp8_dir)
    assert summary.architecture == "LlamaForCausalLM"
    assert summary.high_precision_layers == ["lm_head"]


def _sharded_and_single(model, path):
    """``path`` with both layouts of ``model``: model.safetensors and a sharded copy + index."""
    model.save_pretrained(path / "single")
    model.save_pretrained(path / "sharded", max_shard_size="20KB")
    shutil.copytree(path / "sharded", path / "m")
    shutil.copy(path / "single" / "model.safetensors", path / "m")
    return path / "m"


def test_stale_index_next_to_model_safetensors(tiny_model_dir, tmp_path):
    """transformers 5.24 re-saving a sharded folder unsharded deletes the shards and keeps the
    index (its cleanup only matches shard names); it then loads model.safetensors. hf_fp8
    reads what transformers reads."""
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    path = _sharded_and_single(model, tmp_path)
    for shard in path.glob("model-0*.safetensors"):
        shard.unlink()
    assert (path / "model.safetensors.index.json").is_file()
    AutoModelForCausalLM.from_pretrained(path)  # transformers loads it
    assert len(inspect_checkpoint(path).fp8_layers) == 14
    out = export_checkpoint(path, tmp_path / "ct")
    assert not (out / "model.safetensors.index.json").exists()
    assert (
        load_file(out / "model.safetensors").keys() == load_file(path / "model.safetensors").keys()
    )


def test_stale_model_safetensors_next_to_index(tiny_model_dir, tmp_path):
    """The other way round (an unsharded folder re-saved sharded keeps model.safetensors):
    transformers keeps loading model.safetensors; so does hf_fp8, even with broken shards."""
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    path = _sharded_and_single(model, tmp_path)
    for shard in path.glob("model-0*.safetensors"):
        shard.write_bytes(b"not safetensors")
    AutoModelForCausalLM.from_pretrained(path)
    assert len(inspect_checkpoint(path).fp8_layers) == 14
    export_checkpoint(path, tmp_path / "ct")
