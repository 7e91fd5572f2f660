"""Reviewer R41 F2: ``hf-fp8 inspect`` printed names and values read from a checkpoint raw. A
tensor named ``…self_attn\\x1b[2J\\x1b[31m\\nscheme          all good, no KV cache\\x1b[0m.k_scale``
cleared the terminal and forged a report row; an ``architectures`` entry or a
``quant_method`` did the same in their rows, and an error or warning naming such a tensor
carried the escapes to stderr. The text output now shows every control / format character
escaped the way ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u202e``), one report row per line;
``--json`` keeps the exact strings (JSON escapes them).

References: the names written into the checkpoint here (for ``--json``) and their escaped
spellings typed out below (for the text)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_fp8.cli import main
from hf_fp8.serialization import export_checkpoint
from tests.serialization.helpers import quantized

# clear screen, red, a newline and a forged row, a right-to-left override, a line separator
HOSTILE = "\x1b[2J\x1b[31m\nscheme          all good, no KV cache\x1b[0m\u202e\u2028x"
# the same as the text output must spell it (typed out, not computed)
ESCAPED = r"\x1b[2J\x1b[31m\nscheme          all good, no KV cache\x1b[0m\u202e\u2028x"
KV_NAME = f"model.layers.0.self_attn{HOSTILE}.k_scale"


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dir, tmp_path_factory):
    model = quantized(tiny_model_dir("llama"), "dynamic-row-token")
    path = tmp_path_factory.mktemp("r41_escape") / "fp8"
    model.save_pretrained(path)
    return path


def _copy(src: Path, dst: Path, *, tensors=None, config=None, qc=None) -> Path:
    shutil.copytree(src, dst)
    if tensors:
        state = load_file(dst / "model.safetensors")
        state.update(tensors)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    if config or qc:
        data = json.loads((dst / "config.json").read_text())
        data.update(config or {})
        data["quantization_config"].update(qc or {})
        (dst / "config.json").write_text(json.dumps(data))
    return dst


def _rows(out: str) -> list[str]:
    """The report's lines, split on newlines only (``splitlines`` would also split on the
    line separators the report must not contain)."""
    lines = out.split("\n")
    assert lines[-1] == "", repr(out)
    return lines[:-1]


def _assert_clean(text: str) -> None:
    for line in _rows(text):
        assert line.isprintable(), repr(line)  # no ESC, CR, RLO, U+2028 … left raw


def test_kv_scale_name_is_escaped_in_text_and_exact_in_json(fp8_dir, tmp_path, capsys):
    src = _copy(fp8_dir, tmp_path / "src", tensors={KV_NAME: torch.tensor(1.0)})
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    _assert_clean(out)
    rows = _rows(out)
    assert [r for r in rows if r.startswith("scheme")] == [
        "scheme          dynamic: e4m3 weights per output channel, activations e4m3 per "
        "token (dynamic scales)"
    ]
    kv = [r for r in rows if r.startswith("kv cache")]
    assert len(kv) == 1 and f"model.layers.0.self_attn{ESCAPED}.k_scale" in kv[0], kv
    assert main(["inspect", str(src), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_cache_scales"] == [KV_NAME]  # the exact name, as stored


def test_architecture_row_is_escaped(fp8_dir, tmp_path, capsys):
    arch = f"LlamaForCausalLM{HOSTILE}"
    src = _copy(fp8_dir, tmp_path / "src", config={"architectures": [arch]})
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    _assert_clean(out)
    rows = _rows(out)
    assert f"architecture    LlamaForCausalLM{ESCAPED}" in rows, rows
    assert sum(r.startswith("scheme") for r in rows) == 1, rows
    assert main(["inspect", str(src), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == arch


def test_format_and_scheme_rows_are_escaped(fp8_dir, tmp_path, capsys):
    method = f"awq{HOSTILE}"
    src = _copy(fp8_dir, tmp_path / "src", qc={"quant_method": method})
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    _assert_clean(out)
    rows = _rows(out)
    assert f"format          awq{ESCAPED}" in rows, rows
    assert [r for r in rows if r.startswith("scheme")] == [
        f"scheme          awq{ESCAPED}: not an FP8 format hf_fp8 reads"
    ]
    assert main(["inspect", str(src), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == method


def test_error_naming_a_hostile_tensor_is_one_escaped_line(tiny_model_dir, tmp_path, capsys):
    """``hf-fp8 import`` of a vLLM fp8 checkpoint refuses its KV-cache scale, naming it."""
    model = quantized(tiny_model_dir("llama"), "dynamic-tensor-tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = export_checkpoint(model, tmp_path / "vllm", "vllm-fp8")
    src = _copy(Path(exported), tmp_path / "src", tensors={KV_NAME: torch.tensor(1.0)})
    capsys.readouterr()  # the progress bars of the load above
    assert main(["import", str(src), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    _assert_clean(err)
    assert len(_rows(err)) == 1, err
    # whitespace (the newline, U+2028) is folded into the one line; ESC and RLO are escaped
    assert r"self_attn\x1b[2J\x1b[31m scheme all good, no KV cache\x1b[0m\u202e x.k_scale" in err
    assert not (tmp_path / "out").exists()


def test_warning_text_is_escaped(tmp_path):
    """A warning raised during a command (the export's warnings name the checkpoint's layers)
    reaches stderr escaped. The export is replaced by one that warns with a hostile name."""
    code = (
        "import sys, warnings\n"
        "import hf_fp8.serialization as s\n"
        "from hf_fp8 import cli\n"
        "def export(*a, **k):\n"
        f"    warnings.warn('layer ' + {KV_NAME!r} + ' warns', UserWarning)\n"
        "    return 'out'\n"
        "s.export = export\n"
        "sys.exit(cli.main(['export', 'src', '--out', 'out']))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    _assert_clean(done.stderr)
    assert f"layer model.layers.0.self_attn{ESCAPED}.k_scale warns" in done.stderr, done.stderr
