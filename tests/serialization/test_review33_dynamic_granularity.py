"""Reviewer R33 F2: vLLM quantizes the dynamic activations of non-block FP8 weights per token
whatever a compressed-tensors checkpoint's ``strategy`` says (``CompressedTensorsW8A8Fp8``:
per tensor when static, else per token), and those of block weights in ``1 × k`` groups. A
compressed-tensors export of dynamic per-tensor or group activations on non-block weights (and
of token / tensor activations on block weights, in either format) was written silently; vLLM
serves numbers a few % off the model's. The export now warns, naming vLLM, the granularity it
runs and the fix. The warning is checked against an fp32 emulation of vLLM's per-token
quantization of the model's own layer: it fires exactly where that emulation differs."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from hf_fp8.serialization import export_checkpoint
from tests.serialization.helpers import SCHEMES, quantized

LAYER = "model.layers.0.mlp.down_proj"
TOKEN_SERVED = ["dynamic-row-token", "dynamic-tensor-token", "dynamic-tensor-tensor"]
TOKEN_SERVED += ["dynamic-row-block"]
BLOCK_WEIGHTS = {
    "dynamic-block-token": {**SCHEMES["dynamic-block"], "activation_granularity": "token"},
    "dynamic-block-tensor": {**SCHEMES["dynamic-block"], "activation_granularity": "tensor"},
}


def _granularity_warnings(model, out, fmt) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_checkpoint(model, out, fmt)
    return [str(w.message) for w in caught if "vLLM quantizes the dynamic" in str(w.message)]


@torch.no_grad()
def _vllm_per_token_differs(layer) -> bool:
    """fp32 emulation of vLLM's dynamic per-token activations on the layer's own FP8 weight."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, layer.in_features, generator=gen)
    x = x * torch.logspace(-2, 1, 12)[None, :, None]  # tokens of very different ranges
    scale = x.abs().amax(-1, keepdim=True) / 448.0
    xq = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    want = xq @ layer.dequantize_weight(torch.float32).T
    if layer.bias is not None:
        want = want + layer.bias
    diff = float((layer(x) - want).abs().max() / want.abs().max())
    assert diff < 1e-5 or diff > 1e-3, diff  # the same numbers, or plainly others
    return diff > 1e-3


@pytest.mark.parametrize("scheme", TOKEN_SERVED)
def test_compressed_tensors_warns_where_vllm_runs_other_numbers(tiny_model_dir, tmp_path, scheme):
    model = quantized(tiny_model_dir("llama"), scheme)
    found = _granularity_warnings(model, tmp_path / "out", "compressed-tensors")
    acts = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    strategy = acts["config_groups"]["group_0"]["input_activations"]["strategy"]
    differs = _vllm_per_token_differs(model.get_submodule(LAYER))
    assert differs == (strategy != "token")
    if not differs:
        assert found == []
        return
    assert len(found) == 1, found
    assert "per token" in found[0] and strategy in found[0], found[0]
    assert 'Fp8Config("dynamic")' in found[0], found[0]  # the fix


@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-fp8"])
@pytest.mark.parametrize("name", sorted(BLOCK_WEIGHTS))
def test_block_weights_with_other_dynamic_activations_warn(tiny_model_dir, tmp_path, name, fmt):
    from transformers import AutoModelForCausalLM

    from hf_fp8 import Fp8Config

    kwargs = dict(BLOCK_WEIGHTS[name])
    config = Fp8Config(kwargs.pop("activation_scheme"), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), quantization_config=config
    )
    found = _granularity_warnings(model, tmp_path / "out", fmt)
    assert len(found) == 1, found
    assert "1 × 32 groups" in found[0], found[0]
    assert 'weight_granularity="block"' in found[0], found[0]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "vllm-fp8"])
def test_block_weights_with_block_activations_do_not_warn(tiny_model_dir, tmp_path, fmt):
    model = quantized(tiny_model_dir("llama"), "dynamic-block")
    assert _granularity_warnings(model, tmp_path / "out", fmt) == []
