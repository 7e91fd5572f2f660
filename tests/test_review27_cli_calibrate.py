"""R27: ``hf-fp8 calibrate``'s counts are checked by the parser, with the flag's name.

``--batch-size 0`` crashed in range(), ``--max-length 0`` in a reshape, ``--max-samples -1``
silently dropped the last sample, ``--batch-size -2`` / ``--max-samples 0`` named the Python
API. Each now stops before any file is read: a usage error (exit 2) naming the flag."""

from __future__ import annotations

import pytest

from hf_fp8.cli import main


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--batch-size", "0"),
        ("--batch-size", "-2"),
        ("--max-length", "0"),
        ("--max-samples", "-1"),
        ("--max-samples", "0"),
        ("--batch-size", "eight"),
    ],
)
def test_bad_counts_are_usage_errors_naming_the_flag(tmp_path, capsys, flag, value):
    data = tmp_path / "data.txt"
    data.write_text("one sample\nanother sample\n")
    out = tmp_path / "out"
    code = main(
        [
            "calibrate",
            str(tmp_path / "no-model"),
            "--data",
            str(data),
            "--out",
            str(out),
            flag,
            value,
        ]
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("hf-fp8")]
    assert code == 2, err
    assert len(lines) == 1, err
    assert f"argument {flag}:" in lines[0] and "at least 1" in lines[0], lines[0]
    assert not out.exists()


def test_good_counts_parse(tmp_path):
    from hf_fp8.cli import build_parser

    args = build_parser().parse_args(
        [
            "calibrate",
            "m",
            "--data",
            "d.txt",
            "--out",
            "o",
            "--batch-size",
            "1",
            "--max-length",
            "1",
            "--max-samples",
            "1",
        ]
    )
    assert (args.batch_size, args.max_length, args.max_samples) == (1, 1, 1)
