"""save_pretrained of an hf_fp8 model: atomic over an existing checkpoint, and a card problem
never fails the save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.hub import card as card_module
from hf_fp8.hub import read_card_info

ROOT = Path(__file__).resolve().parents[2]


def _fp8(tiny_model_dir, scheme="dynamic"):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=hf_fp8.Fp8Config(scheme)
    )


def test_card_problem_warns_and_the_save_completes(tiny_model_dir, tmp_path, monkeypatch):
    model = _fp8(tiny_model_dir)

    def broken():
        raise FileNotFoundError("template gone")

    monkeypatch.setattr(card_module, "default_template", broken)
    with pytest.warns(UserWarning, match="model card was not written.*template gone"):
        model.save_pretrained(tmp_path / "fp8")
    assert not (tmp_path / "fp8" / "README.md").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name].view(torch.uint8), tensor.view(torch.uint8))


def test_resave_keeps_other_files_and_the_user_card(tiny_model_dir, tmp_path):
    out = tmp_path / "fp8"
    _fp8(tiny_model_dir).save_pretrained(out)
    (out / "adapter_model.safetensors").write_text("lora")
    (out / "model-00001-of-00002.safetensors").write_text("stale shard of an older save")
    (out / "README.md").write_text("---\nlicense: mit\n---\n\n# Mine\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no card warning
        _fp8(tiny_model_dir, "weight_only").save_pretrained(out)
    assert (out / "adapter_model.safetensors").read_text() == "lora"
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert "# Mine" in (out / "README.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.quantization_config.activation_scheme == "weight_only"


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import transformers.modeling_utils as modeling_utils
    import hf_fp8
    from transformers import AutoModelForCausalLM

    src, dest = sys.argv[1:3]
    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=hf_fp8.Fp8Config("weight_only")
    )
    real = modeling_utils.safe_save_file

    def save_half_then_die(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        data = open(filename, "rb").read()
        open(filename, "wb").write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)  # killed half-way through writing the weights

    modeling_utils.safe_save_file = save_half_then_die
    model.save_pretrained(dest)
    """
)


@pytest.mark.slow
def test_killed_save_over_a_checkpoint_leaves_the_old_one_loadable(tiny_model_dir, tmp_path):
    """Plain ``model.save_pretrained(dest)`` (the hook makes it atomic), killed mid-write."""
    dest = tmp_path / "fp8"
    old_model = _fp8(tiny_model_dir)
    old_model.save_pretrained(dest)
    old = load_file(dest / "model.safetensors")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_FP8_COMPILE": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, tiny_model_dir("llama"), str(dest)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    loaded = AutoModelForCausalLM.from_pretrained(dest)
    assert loaded.config.quantization_config.activation_scheme == "dynamic"
    for name, tensor in load_file(dest / "model.safetensors").items():
        assert torch.equal(tensor.view(torch.uint8), old[name].view(torch.uint8)), name
    assert read_card_info((dest / "README.md").read_text()) is not None


def test_save_into_the_current_directory_is_written_in_place(tiny_model_dir, tmp_path, monkeypatch):
    """Reviewer: ``save_pretrained(".")`` swapped the current directory away (os.getcwd()
    then raised). Now written in place: the old shards go, the user's files stay, the folder
    is the same one and the new model loads."""
    work = tmp_path / "work"
    _fp8(tiny_model_dir).save_pretrained(work, max_shard_size="20KB")
    assert (work / "model.safetensors.index.json").is_file()
    (work / "notes.txt").write_text("mine")
    inode = work.stat().st_ino
    monkeypatch.chdir(work)
    model = _fp8(tiny_model_dir, "weight_only")
    model.save_pretrained(".")
    assert Path(os.getcwd()) == work and work.stat().st_ino == inode
    names = sorted(p.name for p in work.iterdir())
    assert "model.safetensors" in names and "notes.txt" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]
    assert not [n for n in names if "hf_fp8-tmp" in n]
    loaded = AutoModelForCausalLM.from_pretrained(work)
    assert loaded.config.quantization_config.activation_scheme == "weight_only"
    want = model.state_dict()
    for name, tensor in load_file(work / "model.safetensors").items():
        assert torch.equal(tensor.view(torch.uint8), want[name].view(torch.uint8)), name
