"""Reviewer R33 F3: a group of linears vLLM fuses (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) with only some members kept in high precision exported silently, and vLLM
refused the checkpoint at load ("Found different quantization schemes for the shards of
…qkv_proj"). The export now refuses it in both formats, naming the modules and the fix (keep
all siblings in high precision or none), and writes nothing. vLLM's rule is restated below from
its source (``should_ignore_layer`` / ``is_layer_skipped`` with the model's
``packed_modules_mapping``), so the exports that pass are checked against it."""

from __future__ import annotations

import json
import warnings

import pytest
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.serialization import export_checkpoint

FORMATS = ("compressed-tensors", "vllm-fp8")
# vLLM's Llama packed_modules_mapping
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LAYERS = [f"model.layers.{i}.{part}" for i in range(2) for part in ("self_attn", "mlp")]


def vllm_loads(ignore: list[str], parent: str) -> bool:
    """vLLM: the shards of the fused layer under ``parent`` are all ignored or none."""
    shards = VLLM_FUSED["qkv_proj" if parent.endswith("self_attn") else "gate_up_proj"]
    return len({f"{parent}.{s}" in ignore for s in shards}) == 1


def _model(path: str, kept: list[str]):
    return AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=Fp8Config(
            "dynamic", weight_granularity="tensor", modules_to_not_convert=["lm_head", *kept]
        ),
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "kept, fp8_sibling, fused",
    [
        (["q_proj"], "k_proj", "qkv_proj"),
        (["k_proj", "v_proj"], "q_proj", "qkv_proj"),
        (["up_proj"], "gate_proj", "gate_up_proj"),
    ],
)
def test_partly_kept_fused_group_is_refused(
    tiny_model_dir, tmp_path, fmt, kept, fp8_sibling, fused
):
    model = _model(tiny_model_dir("llama"), kept)
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as err:
            export_checkpoint(model, out, fmt)
    message = str(err.value)
    assert f"model.layers.0.self_attn.{kept[0]}" in message or f"mlp.{kept[0]}" in message
    assert fp8_sibling in message, message
    assert fused in message, message  # what vLLM fuses them into
    assert "modules_to_not_convert" in message, message  # the fix
    assert not out.exists()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kept", [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"], []])
def test_whole_fused_groups_export(tiny_model_dir, tmp_path, fmt, kept):
    model = _model(tiny_model_dir("llama"), kept)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = export_checkpoint(model, tmp_path / "out", fmt)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ignore = qc.get("ignore", qc.get("ignored_layers"))
    for parent in LAYERS:
        assert vllm_loads(ignore, parent), (parent, ignore)
    for name in kept:
        assert f"model.layers.1.{'self_attn' if name[0] in 'qkv' else 'mlp'}.{name}" in ignore
