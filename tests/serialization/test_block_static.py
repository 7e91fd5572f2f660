"""Block-wise weight scales with STATIC activation scales, exported for vLLM.

vLLM has no such kernel: its block-FP8 paths quantize activations dynamically in ``1 × k``
groups. Its ``fp8`` format and its compressed-tensors linear refuse the checkpoint at load
(``Fp8Config`` raises, ``CompressedTensorsW8A8Fp8`` asserts ``not is_static_input_scheme``),
but its compressed-tensors fused-MoE method loads block experts with static input scales and
runs them dynamic (``activation_key = kFp8Dynamic128Sym`` whenever the weights are block):
the served experts silently differ from the checkpoint's numerics.

Known gaps: the vllm-fp8 refusal sent the user to compressed-tensors; the compressed-tensors
export wrote static block experts without a word; and it wrote static block linears that
vLLM refuses, without saying so.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import hf_fp8
from hf_fp8 import Fp8Config
from hf_fp8.serialization import export_checkpoint
from tests.serialization.helpers import quantized
from tests.serialization.moe_fixtures import tiny_qwen3_moe

BLOCK = [32, 32]
STATIC_BLOCK = dict(weight_granularity="block", block_size=BLOCK)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "hp"
    tiny_qwen3_moe().save_pretrained(path)
    return path


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(seed))


def _moe(path, scheme: str, **kwargs):
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=Fp8Config(scheme, **kwargs)
    ).eval()
    if scheme == "static":
        hf_fp8.calibrate(model, [{"input_ids": _ids(s)} for s in (1, 2)], progress=False)
    return model


def _names_both_fixes(message: str) -> None:
    assert 'Fp8Config("dynamic", weight_granularity="block")' in message
    assert 'Fp8Config("static", weight_granularity="tensor")' in message


def test_vllm_fp8_refusal_names_recipes_vllm_runs(tiny_model_dir, tmp_path):
    model = quantized(tiny_model_dir("llama"), "static-block")
    with pytest.raises(ValueError, match="dynamic activations") as err:
        export_checkpoint(model, tmp_path / "vllm", "vllm-fp8")
    message = str(err.value)
    _names_both_fixes(message)
    # compressed-tensors is no way into vLLM for this scheme: the message must not say so
    assert "vLLM cannot load it in compressed-tensors either" in message
    assert not (tmp_path / "vllm").exists()


def test_static_block_experts_are_refused_for_compressed_tensors(moe_dir, tmp_path):
    model = _moe(moe_dir, "static", **STATIC_BLOCK)
    with pytest.raises(ValueError, match="drops the static input scales") as err:
        export_checkpoint(model, tmp_path / "ct", "compressed-tensors")
    message = str(err.value)
    _names_both_fixes(message)
    assert "model.layers.0.mlp.experts" in message and "modules_to_not_convert" in message
    assert not (tmp_path / "ct").exists()


def test_what_vllm_would_serve_differs_from_the_static_block_model(moe_dir):
    """The refusal's reason, measured: the static block model against the same model whose
    experts run as vLLM's fused-MoE block path would, with dynamic ``1 × 32`` activation
    groups instead of the calibrated static scales (same FP8 expert weights; everything
    else, attention included, is the static model's own)."""
    static = _moe(moe_dir, "static", **STATIC_BLOCK)
    dynamic = _moe(moe_dir, "dynamic", **STATIC_BLOCK, activation_granularity="block")
    served = copy.deepcopy(static)
    for i, layer in enumerate(served.model.layers):
        twin = dynamic.model.layers[i].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp.experts, proj), getattr(twin, proj))
            assert torch.equal(
                getattr(layer.mlp.experts, f"{proj}_weight_scale"),
                getattr(twin, f"{proj}_weight_scale"),
            )
        layer.mlp.experts = twin
    with torch.no_grad():
        want, got = static(_ids()).logits, served(_ids()).logits
    rel = float((got - want).norm() / want.norm())
    print(f"relative logits difference {rel:.4f}")
    assert rel > 1e-3, rel  # not a rounding difference: a different model


def test_static_block_linears_warn_that_vllm_refuses_them(tiny_model_dir, tmp_path):
    """Dense: transformers loads the export (test_compressed_tensors), vLLM refuses it."""
    model = quantized(tiny_model_dir("llama"), "static-block")
    with pytest.warns(UserWarning, match="vLLM refuses") as record:
        export_checkpoint(model, tmp_path / "ct", "compressed-tensors")
    _names_both_fixes(str(record[0].message))
    assert (tmp_path / "ct" / "config.json").is_file()
