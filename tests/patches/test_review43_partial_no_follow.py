"""Trust check: ``optimizer.bin`` is written through a hidden partial file of a predictable
name (``.optimizer.bin.hf_fp8-partial-<host>-<pid>``). A link planted under that name was
followed: the write landed outside the checkpoint folder. The partial file is now created
exclusively, without following links; a planted link is refused, naming it, and a stale
regular file of this user under the name is replaced. References: the bytes of the planted
target, read before and after, and ``torch.load`` of the written file."""

from __future__ import annotations

import os

import pytest
import torch

from hf_fp8.patches.accelerate_fsdp2 import _partial_name, _save_whole

STATE = {"state": {}, "param_groups": []}


def test_a_link_planted_at_the_partial_name_is_not_followed(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    link = folder / _partial_name("optimizer.bin")
    link.symlink_to(outside)
    with pytest.raises(ValueError, match="is not a file hf_fp8 left") as err:
        _save_whole(STATE, str(folder / "optimizer.bin"))
    assert str(link) in str(err.value)
    assert outside.read_bytes() == b"keep me"
    assert not (folder / "optimizer.bin").exists()
    assert link.is_symlink()  # not removed: it is not ours


def test_a_stale_partial_file_under_the_name_is_replaced(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / _partial_name("optimizer.bin")).write_bytes(b"half a file")
    _save_whole(STATE, str(folder / "optimizer.bin"))
    assert torch.load(folder / "optimizer.bin", weights_only=True) == STATE
    assert sorted(os.listdir(folder)) == ["optimizer.bin"]
