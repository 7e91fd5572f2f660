"""The CLI's and the export's card reads go through hf_fp8.hub.card_file too (R14 3, 4).

A FIFO or oversized README.md in the folder read is refused without blocking
or reading it whole, and an export of a model cast after its figures were recorded states
no figures (they were measured in another compute dtype).
"""

from __future__ import annotations

import os
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.cli import main
from hf_fp8.hub import read_card_info
from hf_fp8.hub.card_file import MAX_CARD_BYTES
from hf_fp8.serialization.atomic import UnsafePathError
from tests.hub.test_review9b_card_file import _finishes

FP32 = {"logits relative L2 vs high precision": 0.080242}


@pytest.fixture
def fp8_dir(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config("dynamic")
    )
    hf_fp8.set_card_info(model, fidelity=FP32)
    model.save_pretrained(tmp_path / "fp8")
    return tmp_path / "fp8"


def test_export_of_a_cast_model_states_no_float32_figures(fp8_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(fp8_dir)
    model.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="measured in float32"):
        out = hf_fp8.export(model, tmp_path / "ct", format="compressed-tensors")
    assert read_card_info((out / "README.md").read_text()).fidelity == {}


def test_export_refuses_a_fifo_card_in_its_source(fp8_dir, tmp_path):
    (fp8_dir / "README.md").unlink()
    os.mkfifo(fp8_dir / "README.md")
    done, exc = _finishes(lambda: hf_fp8.export(fp8_dir, tmp_path / "ct"))
    assert done and isinstance(exc, UnsafePathError) and "not a regular file" in str(exc)
    assert not (tmp_path / "ct").exists()


def test_export_refuses_an_oversized_card_in_its_output(fp8_dir, tmp_path):
    out = tmp_path / "ct"
    out.mkdir()
    with open(out / "README.md", "wb") as f:
        f.truncate(MAX_CARD_BYTES + 1)
    with pytest.raises(UnsafePathError, match="more than a model card may have"):
        hf_fp8.export(fp8_dir, out, overwrite=True)
    assert (out / "README.md").stat().st_size == MAX_CARD_BYTES + 1


def test_quantize_overwrite_refuses_a_fifo_card(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", tiny_model_dir("llama"), "--out", str(out)]) == 0
    (out / "README.md").unlink()
    os.mkfifo(out / "README.md")
    rc: list[int] = []
    argv = ["quantize", tiny_model_dir("llama"), "--out", str(out), "--overwrite"]
    done, exc = _finishes(lambda: rc.append(main(argv)))
    assert done and exc is None and rc and rc[0] != 0
    assert "README.md is not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.lstat(out / "README.md").st_mode)  # left as it was
