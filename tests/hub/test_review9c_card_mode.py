"""The card's permissions follow the umask like the weights' (R17 F3).

A new README.md gets ``0o666 & ~umask``, as ``open()`` gives config.json and the weights; a
card that replaces an old regular one keeps the old one's mode. The reference is the mode of a
file the test writes itself with ``open()`` under the same umask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.hub.card_file import write_card


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("umask", [0o077, 0o027, 0o002, 0o022])
def test_a_new_card_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        card = write_card(tmp_path, "# card\n")
        (tmp_path / "config.json").write_text("{}")  # what a plain open() gives
    finally:
        os.umask(old)
    assert _mode(card) == _mode(tmp_path / "config.json") == 0o666 & ~umask
    assert card.read_text() == "# card\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json"]


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664])
def test_a_replaced_card_keeps_its_mode_under_any_umask(tmp_path, mode):
    (tmp_path / "README.md").write_text("old")
    os.chmod(tmp_path / "README.md", mode)
    old = os.umask(0o077)
    try:
        card = write_card(tmp_path, "new")
    finally:
        os.umask(old)
    assert _mode(card) == mode and card.read_text() == "new"


def test_save_pretrained_card_is_as_private_as_the_weights(tiny_model_dir, tmp_path):
    """R17 e2e case (b): under ``umask 077`` nothing in the saved folder is world-readable."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config("dynamic")
    )
    out = tmp_path / "out"
    old = os.umask(0o077)
    try:
        model.save_pretrained(out)
    finally:
        os.umask(old)
    modes = {p.name: _mode(p) for p in out.iterdir()}
    assert modes["README.md"] == modes["model.safetensors"] == modes["config.json"] == 0o600
