"""R25 F6: what the command line (and the load-time refusal) tells users.

(a) after ``hf-fp8 import``: an installed hf-fp8 loads hf_fp8 checkpoints without
``import hf_fp8`` (``hf-fp8-autoload.pth``; ``HF_FP8_AUTOLOAD=0`` turns that off), so the texts
no longer say to load "after `import hf_fp8`".
(b) ``hf-fp8 calibrate`` computes static scales, one per tensor: its help does not describe the
dynamic choices as its default, a per-token request is refused before anything is loaded
with a fix that names options calibrate has, and recipe messages keep their quotes straight.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import hf_fp8.serialization
from hf_fp8 import Fp8Config, cli
from hf_fp8.quantizer import lost_config


def test_import_says_loadable_without_import(tmp_path, capsys, monkeypatch):
    out = tmp_path / "imported"
    monkeypatch.setattr(hf_fp8.serialization, "import_checkpoint", lambda *a, **k: out)
    code = cli.main(["import", str(tmp_path / "ct"), "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "after `import hf_fp8`" not in text
    assert "from_pretrained" in text and "no `import hf_fp8` needed" in text
    assert "HF_FP8_AUTOLOAD=0" in text  # the only case where the import is needed


@pytest.mark.parametrize("quantizing", [None, "torchao"])
def test_lost_config_fix_says_loadable_without_import(tmp_path, quantizing):
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}})
    )
    file = str(tmp_path / "model.safetensors")
    config = types.SimpleNamespace(
        quantization_config=None if quantizing else {"quant_method": "compressed-tensors"}
    )
    fix = lost_config._fix_for_file(file, config, "and do not pass config=", quantizing)
    assert "hf-fp8 import" in fix
    assert "after `import hf_fp8`" not in fix
    assert "from_pretrained" in fix and "HF_FP8_AUTOLOAD=0" in fix


def _option_help(command: str, option: str) -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    action = next(a for a in sub._actions if option in a.option_strings)
    return f"{action.help} {action.choices} {action.default}"


def test_calibrate_help_describes_static_scales():
    words = _option_help("calibrate", "--activation-granularity")
    assert "per token (default)" not in words
    assert "tensor" in words and "static" in words
    # quantize keeps the dynamic choices
    assert "per token" in _option_help("quantize", "--activation-granularity")


def test_calibrate_per_token_is_refused_with_a_calibrate_fix(tmp_path, capsys):
    data = tmp_path / "samples.txt"
    data.write_text("one sample\n")
    argv = ["calibrate", str(tmp_path / "no-model"), "--data", str(data)]
    code = cli.main([*argv, "--activation-granularity", "token", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code != 0
    assert "--activation-granularity token" in err
    assert "--scheme static/dynamic" not in err and "row'" not in err
    assert "hf-fp8 quantize" in err and "--scheme dynamic" in err  # where per-token scales are
    assert not (tmp_path / "o").exists()


def test_recipe_message_in_cli_words_has_no_stray_quote():
    with pytest.raises(ValueError) as info:
        Fp8Config("static", activation_granularity="token", activation_scale=0.1)
    text = cli._message(info.value)
    assert "--weight-granularity row;" in text or "--weight-granularity row " in text
    assert "row'" not in text and "'token'" not in text
    assert "--activation-granularity token" in text


def test_calibrate_tensor_granularity_still_accepted():
    args = cli.build_parser().parse_args(
        ["calibrate", "m", "--data", "d.txt", "--activation-granularity", "tensor", "--out", "o"]
    )
    assert args.activation_granularity in ("tensor", None)
    assert Path(args.out).name == "o"
