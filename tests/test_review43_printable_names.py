"""R43 F3: the command line's escaping of checkpoint text (R41 F2) escaped characters that
belong in real names: the ideographic space U+3000, the no-break space U+00A0, the zero-width
non-joiner / joiner U+200C / U+200D (Persian words, emoji sequences). A path copied from an
error message then no longer named the folder. Only what can move the cursor, forge a line or
reorder the text is escaped: controls (ESC, CR, newline …), line / paragraph separators and the
bidirectional overrides and isolates. References: spellings typed out here."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.cli import main
from hf_fp8.serialization.printable import printable
from tests.tiny_models import TINY

NAME = "モデル\u3000v2 نیم\u200cفاصله\xa0café 👩\u200d💻"


def test_real_names_print_as_they_are():
    assert printable(NAME) == NAME


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a\x1b[2Jb", r"a\x1b[2Jb"),
        ("a\nb\rc", r"a\nb\rc"),
        ("a\u2028b\u2029c", r"a\u2028b\u2029c"),
        ("abc\u202edef\u2066g\u2069\u200f", r"abc\u202edef\u2066g\u2069\u200f"),
        ("a\x85b\x9bc", r"a\x85b\x9bc"),
    ],
)
def test_what_can_forge_or_reorder_text_is_escaped(raw, shown):
    assert printable(raw) == shown


def test_an_error_names_a_unicode_folder_as_it_is(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    config_cls, model_cls, kwargs = TINY["llama"]
    torch.manual_seed(0)
    model_cls(config_cls(**kwargs)).save_pretrained(tmp_path / "float")
    out = tmp_path / NAME
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["quantize", str(tmp_path / "float"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(out) in err, err
