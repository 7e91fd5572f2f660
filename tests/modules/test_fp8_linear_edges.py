"""Fp8Linear edge cases from issues 12 §6-7 and 13: input dtypes, extreme magnitudes, static
saturation, dtype casts, parameter counts. References are nn.Linear / fp64 fake-quant."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config, Fp8Linear, quantize_model
from hf_fp8.modules.saturation import SaturationCounter
from hf_fp8.numerics import fp8_max


def _layer(config: Fp8Config, dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Linear, Fp8Linear]:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False).to(dtype)
    return linear, Fp8Linear.from_linear(linear, config, module_name="blocks.0.fc")


def _fake_quant_reference(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """fp64: per-token fake-quant of x (scale = amax / 448) @ the dequantized weight."""
    x64 = x.double()
    scale = x64.abs().amax(-1, keepdim=True) / fp8_max(layer.weight.dtype)
    xq = (x64 / scale).to(layer.weight.dtype).double() * scale
    return xq @ layer.dequantize_weight(torch.float64).T


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_inputs_raise_like_nn_linear(dtype) -> None:
    """Issue 12 §7: int64 input returned truncated integers where nn.Linear raises."""
    linear, layer = _layer(Fp8Config("dynamic"))
    x = torch.ones(2, 64, dtype=dtype)
    with pytest.raises(RuntimeError):
        linear(x)
    with pytest.raises(RuntimeError, match=rf"floating-point input.*got {dtype}"):
        layer(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 8])  # GEMV and matmul paths
@pytest.mark.parametrize("weights", ["row", "tensor", "block"])
def test_tiny_activations_are_not_flushed_to_zero(dtype, tokens, weights) -> None:
    """Issue 12 §7: activations <= 1e-20 came out as exact zeros."""
    _, layer = _layer(Fp8Config("dynamic", weight_granularity=weights), dtype)
    x = (torch.randn(tokens, 64) * 1e-20).to(dtype)
    with torch.no_grad():
        out = layer(x)
    ref = _fake_quant_reference(x, layer) if weights != "block" else None
    assert bool((out != 0).any())
    if ref is not None:
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel < 0.02  # only the output rounding to `dtype` differs


@pytest.mark.parametrize("tokens", [1, 8])
def test_huge_activations_stay_finite_where_bf16_is_finite(tokens) -> None:
    """Issue 12 §7: activations near 1e38 gave inf where the bf16 layer is finite."""
    linear, layer = _layer(Fp8Config("dynamic"))
    x = (torch.randn(tokens, 64) * 2e37).to(torch.bfloat16)
    with torch.no_grad():
        ref = linear(x)
        out = layer(x)
    assert bool(torch.isfinite(ref).all())
    assert bool(torch.isfinite(out).all())


def _static(scale: float) -> Fp8Linear:
    return _layer(Fp8Config("static", activation_scale=scale))[1]


def test_a_static_scale_that_saturates_often_warns_once_naming_the_layer(monkeypatch) -> None:
    """Issue 12 §6: a static scale far too small saturated without any warning or counter."""
    monkeypatch.setattr(SaturationCounter, "check_every", 4)
    monkeypatch.setattr(SaturationCounter, "sample_every", 2)  # forwards 1, 3, 5, 7 count
    layer = _static(1e-4)  # clips everything above 0.0448
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = float((x.float().abs() > 1e-4 * 448).float().mean())
    with pytest.warns(RuntimeWarning, match=r"blocks\.0\.fc clipped .* over 4 sampled calls"):
        for _ in range(7):
            layer(x)
    assert layer.saturation_fraction() == pytest.approx(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer
        for _ in range(8):
            layer(x)


def test_a_good_static_scale_does_not_warn(monkeypatch) -> None:
    monkeypatch.setattr(SaturationCounter, "check_every", 2)
    monkeypatch.setattr(SaturationCounter, "sample_every", 1)
    layer = _static(8.0 / 448)
    x = torch.randn(3, 64, dtype=torch.bfloat16).clamp(-4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            layer(x)
    assert layer.saturation_fraction() == 0.0


def test_the_counter_adds_no_graph_break_under_torch_compile(monkeypatch) -> None:
    monkeypatch.setattr(SaturationCounter, "check_every", 1)
    monkeypatch.setattr(SaturationCounter, "sample_every", 1)
    layer = _static(1e-4)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    with torch.no_grad(), warnings.catch_warnings(record=True):
        eager = layer(x)
    calls = layer._saturation.calls
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager)
    assert layer._saturation.calls == calls  # nothing counted inside the compiled graph
    torch._dynamo.reset()


@pytest.mark.parametrize("cast", ["half", "float", "bfloat16"])
def test_half_and_float_behave_like_to(cast) -> None:
    """Issue 13: .half() / .float() change the compute dtype like .to(dtype), never fp8."""
    dtype = {"half": torch.float16, "float": torch.float32, "bfloat16": torch.bfloat16}[cast]
    _, a = _layer(Fp8Config("dynamic"), torch.float32)
    _, b = _layer(Fp8Config("dynamic"), torch.float32)
    getattr(a, cast)()
    b.to(dtype)
    for layer in (a, b):
        assert layer.compute_dtype == dtype and layer.weight.dtype == torch.float8_e4m3fn
        assert layer.weight_scale.dtype == torch.float32
    x = torch.randn(2, 64, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_num_parameters_counts_the_scales_on_top_of_the_weights() -> None:
    """Issue 13: the scales are Parameters (transformers' loader, accelerate offload and
    FSDP2 treat them like the fp8 weight they belong to); num_parameters() therefore counts
    them: the count is the high-precision count plus one element per scale."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2))  # fmt: skip
    before = model.num_parameters()
    quantize_model(model, Fp8Config("dynamic"), skip=["lm_head"])
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    scales = sum(m.weight_scale.numel() for m in layers)
    assert model.num_parameters() == before + scales
    assert scales == sum(m.out_features for m in layers)  # row-wise: one per output channel


@pytest.mark.parametrize("cast", ["half", "float"])
def test_a_quantized_transformers_model_casts_with_half_and_float(cast) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2))  # fmt: skip
    quantize_model(model, Fp8Config("weight_only"), skip=["lm_head"])
    dtype = torch.float16 if cast == "half" else torch.float32
    model.to(torch.bfloat16)  # start from a third dtype, so both casts change something
    getattr(model, cast)()
    layer = model.model.layers[0].mlp.down_proj
    assert layer.compute_dtype == dtype and layer.weight.dtype == torch.float8_e4m3fn


def test_layer_attributes_are_plain_strings_for_yaml_and_json() -> None:
    """The recipe holds enums; what a layer exposes (read by cards, summaries, exports) is
    plain ``str``, which yaml.safe_dump and safetensors metadata accept."""
    yaml = pytest.importorskip("yaml")
    _, layer = _layer(Fp8Config("dynamic", weight_granularity="block"))
    words = [layer.activation_scheme, layer.weight_granularity, layer.activation_granularity,
             layer.fp8_format, layer.kernel]  # fmt: skip
    assert all(type(w) is str for w in words)
    assert yaml.safe_load(yaml.safe_dump(words)) == ["dynamic", "block", "block", "e4m3", "auto"]


def test_requires_grad_on_fp8_codes_is_refused_with_the_fix() -> None:
    """Found in issue 11 (HT): ``model.requires_grad_(True)`` flipped the fp8 weight's flag and
    a training step then updated nothing there, silently (its grad stayed None)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    quantize_model(model, Fp8Config("dynamic"))
    model.requires_grad_(True)
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match=r"0\.weight has requires_grad=True.*freeze_fp8"):
        model(x)
    with torch.no_grad():  # inference is untouched
        expected = model(x)
    from hf_fp8.modules import freeze_fp8

    assert freeze_fp8(model) == 2  # weight and weight_scale
    out = model(x)
    out.square().sum().backward()
    assert model[0].weight.grad is None and model[1].weight.grad is not None
    assert model[0].bias.grad is not None  # the bias trains
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)


def test_weight_codes_cast_to_bf16_are_refused_with_the_fix() -> None:
    """Found with accelerate FSDP2 (HA2): a bf16 MixedPrecisionPolicy all-gathers the fp8
    codes as bf16 and Fp8Linear computed with them silently (twice the bytes)."""
    _, layer = _layer(Fp8Config("dynamic"))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    expected = layer(x)
    layer.weight = nn.Parameter(layer.weight.to(torch.bfloat16), requires_grad=False)
    with pytest.raises(TypeError, match=r"got torch.bfloat16.*fully_shard_fp8"):
        layer(x)
    layer.weight = nn.Parameter(layer.weight.to(torch.float8_e4m3fn), requires_grad=False)
    assert torch.equal(layer(x), expected)  # e4m3 -> bf16 -> e4m3 is exact
