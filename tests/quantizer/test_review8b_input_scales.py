"""An offloaded layer's lost input scales are not stood in for by another module's (R7 2).

The renamed-module match (Mixtral saves ``block_sparse_moe``, the model calls it ``mlp``)
compared only ``block.1`` and the last two name parts: a static T5 whose ``decoder.block.1``
lost its scales took the encoder's ``encoder.block.1…q.input_scale`` (or the block's own
cross-attention ``EncDecAttention.q.input_scale``) as stored, was accepted with that block on
disk and failed at forward with ``KeyError``, while the same checkpoint in memory is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.quantizer.input_scales import StoredInputScales
from tests.tiny_models import model_inputs

T5_DECODER_1_ON_DISK = {
    "shared": "cpu",
    "encoder": "cpu",
    "decoder.embed_tokens": "cpu",
    "decoder.block.0": "cpu",
    "decoder.block.1": "disk",
    "decoder.final_layer_norm": "cpu",
    "decoder.dropout": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def t5_static(tiny_model_dir, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A static T5 with distinct input scales saved, and its logits in memory (the reference)."""
    model = AutoModelForSeq2SeqLM.from_pretrained(
        tiny_model_dir("t5"), quantization_config=Fp8Config("static", activation_scale=0.05)
    )
    linears = [m for m in model.modules() if isinstance(m, hf_fp8.Fp8Linear)]
    for i, module in enumerate(linears):  # distinct "calibrated" scales
        module.set_input_scale(0.01 + 0.001 * i)
    path = tmp_path_factory.mktemp("t5_static")
    model.save_pretrained(path)
    with torch.no_grad():
        return path, model(**model_inputs("t5")).logits


def _without(src: Path, dst: Path, lost) -> list[str]:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    dropped = sorted(k for k in tensors if k.endswith("input_scale") and lost(k))
    for key in dropped:
        del tensors[key]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dropped


@pytest.mark.parametrize(
    "lost",
    [
        pytest.param(lambda k: k.startswith("decoder.block.1."), id="whole-block"),
        pytest.param(lambda k: "decoder.block.1.layer.0.SelfAttention.q." in k, id="self-attn-q"),
    ],
)
def test_offloaded_t5_decoder_block_missing_its_scales_is_refused(t5_static, tmp_path, lost):
    folder = tmp_path / "ckpt"
    dropped = _without(t5_static[0], folder, lost)
    assert dropped
    with pytest.raises(CheckpointTensorError, match=r"decoder\.block\.1\.") as in_memory:
        AutoModelForSeq2SeqLM.from_pretrained(folder)
    assert dropped[0] in str(in_memory.value)
    with pytest.raises(CheckpointTensorError, match=re.escape(dropped[0])):
        AutoModelForSeq2SeqLM.from_pretrained(
            folder, device_map=T5_DECODER_1_ON_DISK, offload_folder=tmp_path / "off"
        )


def test_offloaded_complete_t5_matches_the_in_memory_model(t5_static, tmp_path):
    folder, reference = t5_static
    model = AutoModelForSeq2SeqLM.from_pretrained(
        folder, device_map=T5_DECODER_1_ON_DISK, offload_folder=tmp_path / "off"
    )
    with torch.no_grad():
        assert torch.equal(model(**model_inputs("t5")).logits, reference)


def _offloaded_scales(stored: set[str], model: list[str], on_disk: str) -> StoredInputScales:
    """``model``'s scales added, those under ``on_disk`` offloaded (on meta), the others
    loaded from the checkpoint."""
    scales = StoredInputScales(stored)
    for key in model:
        offloaded = key.startswith(on_disk)
        param = torch.empty((), device="meta" if offloaded else "cpu")
        param._is_hf_initialized = not offloaded
        scales.add(key, param, offloaded=offloaded)
    return scales


def test_bart_decoder_layer_does_not_take_the_encoder_layer_scale():
    """``model.encoder.layers.1`` vs ``model.decoder.layers.1`` (BART, Whisper), and the
    decoder layer's own ``encoder_attn.q_proj`` vs its ``self_attn.q_proj``."""
    model = [
        f"model.{side}.layers.1.{attn}.q_proj.input_scale"
        for side, attn in [
            ("encoder", "self_attn"),
            ("decoder", "self_attn"),
            ("decoder", "encoder_attn"),
        ]
    ]
    for lost in model[1:]:
        scales = _offloaded_scales(set(model) - {lost}, model, "model.decoder.layers.1")
        with pytest.raises(CheckpointTensorError, match=re.escape(lost)):
            scales.check("ckpt", None)


def test_mixtral_rename_after_the_layer_index_still_matches():
    stored = {f"model.layers.{i}.block_sparse_moe.experts.w1_input_scale" for i in (0, 1)}
    model = [f"model.layers.{i}.mlp.experts.w1_input_scale" for i in (0, 1)]
    scales = _offloaded_scales(stored, model, "model.layers.1")
    scales.check("ckpt", None)  # layer 1's scale is stored under block_sparse_moe
    assert scales.stored == model and not scales.unfilled


def test_renamed_match_holds_across_the_base_model_prefix():
    """A base-model checkpoint (``layers.1.block_sparse_moe``) under ``model.layers.1.mlp``;
    the prefix is dropped from one side only, so ``block.1`` of the encoder never meets
    ``block.1`` of the decoder."""
    stored = {f"layers.{i}.block_sparse_moe.experts.w1_input_scale" for i in (0, 1)}
    model = [f"model.layers.{i}.mlp.experts.w1_input_scale" for i in (0, 1)]
    scales = _offloaded_scales(stored, model, "model.layers.1")
    scales.check("ckpt", None)
    assert not scales.unfilled
    t5 = ["encoder.block.1.layer.0.SelfAttention.q.input_scale"]
    scales = _offloaded_scales(
        set(t5), [*t5, "decoder.block.1.x.SelfAttention.q.input_scale"], "decoder"
    )
    with pytest.raises(CheckpointTensorError, match=r"decoder\.block\.1"):
        scales.check("ckpt", None)
