"""Reviewer 20 (F1): ``save_pretrained`` of an hf_fp8 model removes only the stale files of the
weight set it wrote, as transformers does -- never ``.bin`` files, never the main weights
beside a variant, nothing at all when only adapter files were written."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_fp8
from tests.tiny_models import LLAMA_ONE_LAYER


def _fp8(path: Path, scheme: str = "dynamic"):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=hf_fp8.Fp8Config(scheme))


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "README.md")


def _equal_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor.view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.fixture
def hp_model():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_ONE_LAYER))


def test_bin_original_saved_back_keeps_its_bin(hp_model, tmp_path):
    """Case A: a .bin-only checkpoint, quantized and saved back into its own folder, lost
    pytorch_model.bin (transformers 5 writes safetensors and keeps the .bin)."""
    folder = tmp_path / "orig"
    folder.mkdir()
    hp_model.config.save_pretrained(folder)
    torch.save(hp_model.state_dict(), folder / "pytorch_model.bin")
    (folder / "pytorch_model-00001-of-00002.bin").write_bytes(b"a user's .bin shard")
    bin_bytes = (folder / "pytorch_model.bin").read_bytes()
    model = _fp8(folder)
    model.save_pretrained(folder)
    assert (folder / "pytorch_model.bin").read_bytes() == bin_bytes
    assert (folder / "pytorch_model-00001-of-00002.bin").read_bytes() == b"a user's .bin shard"
    _equal_bits(load_file(folder / "model.safetensors"), model.state_dict())


def test_variant_save_keeps_the_main_weights(hp_model, tmp_path):
    """Case B: ``save_pretrained(out, variant="fp8v")`` deleted out/model.safetensors: the
    folder no longer loaded without the variant."""
    src = tmp_path / "base"
    hp_model.save_pretrained(src)
    out = tmp_path / "out"
    main = _fp8(src)
    main.save_pretrained(out)
    main_bytes = (out / "model.safetensors").read_bytes()
    variant = _fp8(src, "weight_only")
    variant.save_pretrained(out, variant="fp8v")
    assert (out / "model.safetensors").read_bytes() == main_bytes
    assert "model.fp8v.safetensors" in _files(out)
    _equal_bits(load_file(out / "model.fp8v.safetensors"), variant.state_dict())
    AutoModelForCausalLM.from_pretrained(out)  # still loads without the variant
    AutoModelForCausalLM.from_pretrained(out, variant="fp8v")


def test_variant_resave_drops_only_that_variants_stale_shards(hp_model, tmp_path):
    """A variant saved sharded, then unsharded: its old shards and index go (transformers'
    names: model.fp8v-00001-of-0000N.safetensors, model.safetensors.index.fp8v.json); the
    main weights, their shards and their index stay."""
    src = tmp_path / "base"
    hp_model.save_pretrained(src)
    out = tmp_path / "out"
    model = _fp8(src)
    model.save_pretrained(out, max_shard_size="20KB")  # main weights, sharded
    main = {n: (out / n).read_bytes() for n in _files(out) if n.startswith("model")}
    assert "model.safetensors.index.json" in main and len(main) > 2
    model.save_pretrained(out, variant="fp8v", max_shard_size="20KB")
    names = _files(out)
    assert "model.safetensors.index.fp8v.json" in names
    assert any(n.startswith("model.fp8v-00001-of-") for n in names)
    model.save_pretrained(out, variant="fp8v")  # the variant again, unsharded
    names = _files(out)
    variant_files = [n for n in names if "fp8v" in n]
    assert variant_files == ["model.fp8v.safetensors"]
    assert {n: (out / n).read_bytes() for n in names if n.startswith("model") and n in main} == main
    AutoModelForCausalLM.from_pretrained(out)
    AutoModelForCausalLM.from_pretrained(out, variant="fp8v")


def test_adapter_only_save_keeps_the_base_weights(hp_model, tmp_path, monkeypatch):
    """Case C: an FP8 model with an adapter attached by ``model.load_adapter`` saves only the
    adapter files; the base model.safetensors of the folder was deleted."""
    peft = pytest.importorskip("peft")
    import transformers.integrations.peft as tf_peft

    monkeypatch.setattr(tf_peft, "check_peft_version", lambda **kwargs: None, raising=False)
    src = tmp_path / "base"
    hp_model.save_pretrained(src)
    lora = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(src), peft.LoraConfig(r=4, target_modules=["q_proj"])
    )
    lora.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out"
    _fp8(src).save_pretrained(out)
    base_bytes = (out / "model.safetensors").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out)
    model.load_adapter(str(tmp_path / "adapter"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    names = _files(out)
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names
    assert (out / "model.safetensors").read_bytes() == base_bytes
