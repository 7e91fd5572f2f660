"""R39 F5: the kernel is a runtime / loading choice, not part of a checkpoint. A model quantized
with ``kernel="scaled_mm"`` (an H100 user) saves ``"kernel": "auto"``, so its checkpoint loads
and runs wherever the emulation runs; an older checkpoint that stored ``"scaled_mm"`` is read as
a preference that falls back to ``"auto"`` with a warning where ``torch._scaled_mm`` cannot run;
``kernel="scaled_mm"`` passed at load where it cannot run is refused naming the fix."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.kernels.capability import has_fp8_gemm
from hf_fp8.modules import Fp8Linear

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 3, 7]])
NO_FP8_GEMM = pytest.mark.skipif(has_fp8_gemm(), reason="torch._scaled_mm runs on this machine")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("r39f5")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(root / "float")
    return root


def _kernels(model):
    return {m.kernel for m in model.modules() if isinstance(m, Fp8Linear)}


def _reference_logits(folders):
    """The emulated FP8 model (kernel "auto" on this machine), quantized from the float one."""
    model = hf_fp8.quantize_model(
        AutoModelForCausalLM.from_pretrained(folders / "float"), Fp8Config("dynamic")
    )
    with torch.no_grad():
        return model(IDS).logits


def test_saved_checkpoint_records_no_kernel_choice(folders, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        folders / "float", quantization_config=Fp8Config("dynamic", kernel="scaled_mm")
    )
    assert _kernels(model) == {"scaled_mm"}  # the layers keep the choice made at load
    model.save_pretrained(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    assert saved["kernel"] == "auto"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert _kernels(reloaded) == {"auto"}
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, _reference_logits(folders))
    # quantize_model too
    quantized = hf_fp8.quantize_model(
        AutoModelForCausalLM.from_pretrained(folders / "float"),
        Fp8Config("dynamic", kernel="emulated"),
    )
    assert _kernels(quantized) == {"emulated"}
    quantized.save_pretrained(tmp_path / "b")
    saved = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert saved["kernel"] == "auto"


def _old_checkpoint(folders, tmp_path):
    """A checkpoint saved by an older hf_fp8 with "kernel": "scaled_mm" in config.json."""
    model = AutoModelForCausalLM.from_pretrained(
        folders / "float", quantization_config=Fp8Config("dynamic")
    )
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["kernel"] = "scaled_mm"
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@NO_FP8_GEMM
def test_old_stored_scaled_mm_falls_back_where_it_cannot_run(folders, tmp_path):
    folder = _old_checkpoint(folders, tmp_path)
    with pytest.warns(UserWarning, match=r"kernel='scaled_mm'.*cannot run here.*kernel='auto'"):
        model = AutoModelForCausalLM.from_pretrained(folder)
    assert _kernels(model) == {"auto"}
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _reference_logits(folders))
    model.generate(IDS, max_new_tokens=2, do_sample=False)


@NO_FP8_GEMM
def test_scaled_mm_passed_at_load_where_it_cannot_run_names_the_fix(folders, tmp_path):
    folder = _old_checkpoint(folders, tmp_path)
    with pytest.raises(ValueError, match=r"quantization_config=Fp8Config\(kernel='auto'\)"):
        AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=Fp8Config(kernel="scaled_mm")
        )
    # asking for "auto" (or "emulated") at load is what the error names: it runs
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Fp8Config(kernel="auto")
    )
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _reference_logits(folders))
