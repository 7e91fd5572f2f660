"""Issue 12 §2 (import path) and §7: bad fp8 weights and scales inside compressed-tensors, vLLM
fp8 and hf_fp8 checkpoints fail import, inspect and export with the tensor's name; the vLLM
block export refuses shapes it cannot load; compressed-tensors schemes hf_fp8 cannot represent
are refused (issue 16 §5)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Config
from hf_fp8.cli import main
from hf_fp8.numerics.checks import CheckpointTensorError
from hf_fp8.serialization import export_checkpoint, import_checkpoint, inspect_checkpoint
from tests.serialization.helpers import quantized

LAYER = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def sources(tiny_model_dir, tmp_path_factory):
    """Valid checkpoints to corrupt: hf_fp8, compressed-tensors (row scales, static input
    scales) and vLLM fp8 (scalar scales, static)."""
    root = tmp_path_factory.mktemp("valid")
    path = tiny_model_dir("llama")
    hf = root / "hf_fp8"
    quantized(path, "static-tensor").save_pretrained(hf)
    return {
        "hf_fp8": hf,
        "compressed-tensors": export_checkpoint(quantized(path, "static-row"), root / "ct"),
        "vllm-fp8": export_checkpoint(hf, root / "vllm", "vllm-fp8"),
    }


def _corrupt(src, dst, name, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    assert name in tensors, sorted(tensors)
    tensors[name] = edit(tensors[name])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


BAD = {
    "weight_scale-nan": ("weight_scale", lambda t: torch.full_like(t, float("nan")), "non-finite"),
    "weight_scale-inf": ("weight_scale", lambda t: torch.full_like(t, float("inf")), "non-finite"),
    "weight_scale-zero": ("weight_scale", torch.zeros_like, "must be > 0"),
    "weight_scale-negative": ("weight_scale", lambda t: -t, "must be > 0"),
    "weight_scale-x1e30": ("weight_scale", lambda t: t * 1e30, "exceeds the sane bound"),
    "weight_scale-int32": ("weight_scale", lambda t: t.to(torch.int32), "floating-point"),
    "input_scale-nan": ("input_scale", lambda t: torch.full_like(t, float("nan")), "non-finite"),
    "input_scale-zero": ("input_scale", torch.zeros_like, "must be > 0"),
    "weight-bf16": ("weight", lambda t: t.to(torch.bfloat16), "stored as BF16"),
    "weight-e5m2": ("weight", lambda t: t.float().to(torch.float8_e5m2), "e5m2"),
}


@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-fp8"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tensor_fails_import_and_inspect_with_its_name(fmt, case, sources, tmp_path):
    leaf, edit, message = BAD[case]
    name = f"{LAYER}.{leaf}"
    src = _corrupt(sources[fmt], tmp_path / "bad", name, edit)
    with pytest.raises(CheckpointTensorError, match=message) as err:
        import_checkpoint(src, tmp_path / "out")
    assert name in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointTensorError) as err:
        inspect_checkpoint(src)
    assert name in str(err.value)


@pytest.mark.parametrize("case", ["weight_scale-nan", "weight_scale-zero", "input_scale-nan"])
def test_bad_hf_fp8_tensor_fails_export(case, sources, tmp_path):
    leaf, edit, message = BAD[case]
    name = f"{LAYER}.{leaf}"
    src = _corrupt(sources["hf_fp8"], tmp_path / "bad", name, edit)
    for fmt in ("compressed-tensors", "vllm-fp8"):
        with pytest.raises(CheckpointTensorError, match=message) as err:
            export_checkpoint(src, tmp_path / fmt, fmt)
        assert name in str(err.value)
        assert not (tmp_path / fmt).exists()


def test_cli_import_names_the_tensor_in_one_line(sources, tmp_path, capsys):
    name = f"{LAYER}.weight_scale"
    src = _corrupt(sources["compressed-tensors"], tmp_path / "bad", name, torch.zeros_like)
    assert main(["import", str(src), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-fp8 import: error: ") and name in err[0]


def test_valid_checkpoints_still_import(sources, tmp_path):
    for fmt in ("compressed-tensors", "vllm-fp8"):
        out = import_checkpoint(sources[fmt], tmp_path / fmt)
        assert inspect_checkpoint(out).format == "hf_fp8"


# -- vLLM fp8 blocks must divide every layer (12 §7) -------------------------------------------
def test_vllm_block_export_refuses_non_dividing_blocks(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"),
        quantization_config=Fp8Config(
            "dynamic",
            weight_granularity="block",
            block_size=[48, 48],
            activation_granularity="token",
        ),
    )
    with pytest.raises(ValueError, match=r"divisible by the block: .* 48×48") as err:
        export_checkpoint(model, tmp_path / "v", "vllm-fp8")
    assert "compressed-tensors" in str(err.value)
    assert not (tmp_path / "v").exists()
    ct = export_checkpoint(model, tmp_path / "ct")  # compressed-tensors holds partial blocks
    assert inspect_checkpoint(ct).format == "compressed-tensors"


# -- compressed-tensors schemes hf_fp8 cannot represent (16 §5) --------------------------------
def _group(qc):
    return qc["config_groups"]["group_0"]


UNSUPPORTED = {
    "dynamic-weights": (
        lambda qc: _group(qc)["weights"].update(dynamic=True),
        "weights are dynamic",
    ),
    "output-activations": (
        lambda qc: _group(qc).update(output_activations=dict(_group(qc)["weights"])),
        "output activations",
    ),
    "tensor-group-weights": (
        lambda qc: _group(qc)["weights"].update(strategy="tensor_group", group_size=16),
        "weight strategy 'tensor_group'",
    ),
    "packed-format": (lambda qc: _group(qc).update(format="pack-quantized"), "pack-quantized"),
    "sparsity": (lambda qc: qc.update(sparsity_config={"format": "sparse-24"}), "sparsity_config"),
    "transform": (lambda qc: qc.update(transform_config={"type": "hadamard"}), "transform_config"),
    "no-weights": (lambda qc: _group(qc).pop("weights"), "quantizes no weights"),
    "e8m0-scales": (
        lambda qc: _group(qc)["weights"].update(scale_dtype="torch.float8_e8m0fnu"),
        "scales are stored as torch.float8_e8m0fnu",
    ),
    "dynamic-input-channel": (
        lambda qc: _group(qc)["input_activations"].update(strategy="channel"),
        "input activations 'channel'",
    ),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unrepresentable_compressed_tensors_schemes_are_refused(case, sources, tmp_path):
    edit, message = UNSUPPORTED[case]
    src = tmp_path / "src"
    shutil.copytree(sources["compressed-tensors"], src)
    config = json.loads((src / "config.json").read_text())
    _group(config["quantization_config"])["input_activations"] = {
        "num_bits": 8,
        "type": "float",
        "strategy": "token",
        "dynamic": True,
        "symmetric": True,
    }
    edit(config["quantization_config"])
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported compressed-tensors checkpoint") as err:
        import_checkpoint(src, tmp_path / "out")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


# -- biases of fp8 layers must be high precision (reviewer) ------------------------------------
@pytest.fixture(scope="module")
def biased_hf_fp8(tmp_path_factory):
    import transformers as tf

    root = tmp_path_factory.mktemp("biased")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
        mlp_bias=True,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(root / "hp")
    model = AutoModelForCausalLM.from_pretrained(
        root / "hp", quantization_config=Fp8Config("dynamic", weight_granularity="tensor")
    )
    model.save_pretrained(root / "fp8")
    return root / "fp8"


@pytest.mark.parametrize(
    "dtype", [torch.float8_e5m2, torch.float8_e4m3fn, torch.int32], ids=["e5m2", "e4m3", "int32"]
)
def test_fp8_or_integer_bias_fails_export_with_its_name(biased_hf_fp8, dtype, tmp_path):
    """Reviewer: an fp8 bias passed through export into the compressed-tensors checkpoint."""
    name = f"{LAYER}.bias"
    src = _corrupt(biased_hf_fp8, tmp_path / "bad", name, lambda t: t.to(dtype))
    for fmt in ("compressed-tensors", "vllm-fp8"):
        with pytest.raises(CheckpointTensorError, match=r"bias.*high-precision") as err:
            export_checkpoint(src, tmp_path / fmt, fmt)
        assert name in str(err.value)
        assert not (tmp_path / fmt).exists()


def test_float_bias_still_exports(biased_hf_fp8, tmp_path):
    out = export_checkpoint(biased_hf_fp8, tmp_path / "ct")
    got, ref = load_file(out / "model.safetensors"), load_file(biased_hf_fp8 / "model.safetensors")
    assert torch.equal(got[f"{LAYER}.bias"], ref[f"{LAYER}.bias"])
