"""Fp8Linear: construction, forward against references, state dicts, copies, errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.numerics import sqnr_db
from tests.bitwise import assert_bit_equal, assert_states_bit_equal
from tests.kernels.reference import assert_close_to_reference, fake_quant, reference_linear

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
RECIPES = [
    ("weight_only", "row"),
    ("weight_only", "tensor"),
    ("weight_only", "block"),
    ("dynamic", "row"),
    ("dynamic", "tensor"),
    ("dynamic", "block"),
    ("static", "row"),
    ("static", "tensor"),
]


def _config(scheme: str, granularity: str = "row", **kwargs) -> Fp8Config:
    if scheme == "static":
        kwargs.setdefault("activation_scale", 0.02)
    return Fp8Config(scheme, weight_granularity=granularity, **kwargs)


def _linear(k: int, n: int, bias: bool = True, dtype=torch.bfloat16) -> nn.Linear:
    linear = nn.Linear(k, n, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 0.1)
    return linear


def _expected(module: Fp8Linear, x: torch.Tensor):
    """Reference: fake-quantized activation times dequantized weight, exact."""
    a = x.float().reshape(-1, x.shape[-1])
    if module.activation_scheme == "dynamic":
        a = fake_quant(a, module.activation_granularity, module.block_size[1])
    elif module.activation_scheme == "static":
        s = module.input_scale.float()
        a = (a / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    w = module.dequantize_weight(torch.float32)
    return reference_linear(a, w, module.bias)


@pytest.mark.parametrize(("scheme", "granularity"), RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_from_linear_parameters(scheme, granularity, dtype) -> None:
    linear = _linear(300, 130, dtype=dtype)
    module = Fp8Linear.from_linear(linear, _config(scheme, granularity))
    assert isinstance(module, nn.Linear)
    assert module.weight.dtype == torch.float8_e4m3fn and not module.weight.requires_grad
    assert module.weight.shape == (130, 300)
    assert module.weight_scale.dtype == torch.float32 and not module.weight_scale.requires_grad
    expected_scale = {"tensor": (1,), "row": (130, 1), "block": (2, 3)}[granularity]
    assert module.weight_scale.shape == expected_scale
    assert module.bias.dtype == dtype and module.compute_dtype == dtype
    assert torch.equal(module.bias, linear.bias)
    if scheme == "static":
        assert module.input_scale.shape == (1,) and module.input_scale.item() == pytest.approx(0.02)
        assert not module.input_scale.requires_grad
    else:
        assert module.input_scale is None
    assert module.weight.device.type == "cpu"


@pytest.mark.parametrize(("scheme", "granularity"), RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [(37, 100), (100, 37)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_the_reference(scheme, granularity, dtype, k, n, bias) -> None:
    linear = _linear(k, n, bias, dtype)
    module = Fp8Linear.from_linear(linear, _config(scheme, granularity))
    for shape in [(5, k), (2, 3, k), (1, k)]:
        x = torch.randn(shape).to(dtype)
        out = module(x)
        assert out.shape == (*shape[:-1], n) and out.dtype == dtype
        ref = _expected(module, x)
        folded = granularity == "block"
        assert_close_to_reference(out.reshape(-1, n), ref, dtype, folded=folded)


@pytest.mark.parametrize(("scheme", "granularity"), RECIPES)
def test_close_to_the_high_precision_linear(scheme, granularity) -> None:
    linear = _linear(512, 256, dtype=torch.float32)
    config = (
        _config(scheme, granularity, activation_scale=4.5 / 448)
        if scheme == "static"
        else (_config(scheme, granularity))
    )
    module = Fp8Linear.from_linear(linear, config)
    x = torch.randn(16, 512)
    with torch.no_grad():
        assert sqnr_db(linear(x), module(x)) > (28 if scheme == "weight_only" else 24)


def test_odd_dimensions_100x37_with_the_default_recipe() -> None:
    linear = _linear(37, 100)
    module = Fp8Linear.from_linear(linear)
    assert module.activation_scheme == "dynamic" and module.weight_granularity == "row"
    x = torch.randn(4, 37, dtype=torch.bfloat16)
    assert module(x).shape == (4, 100)


@pytest.mark.parametrize(("scheme", "granularity"), RECIPES)
def test_dequantize_gives_a_plain_linear(scheme, granularity) -> None:
    module = Fp8Linear.from_linear(_linear(64, 48), _config(scheme, granularity))
    plain = module.dequantize()
    assert type(plain) is nn.Linear
    assert plain.weight.dtype == torch.bfloat16 and plain.bias.dtype == torch.bfloat16
    assert torch.equal(plain.weight, module.dequantize_weight())
    assert torch.equal(plain.bias, module.bias)
    if scheme == "weight_only":
        x = torch.randn(6, 64, dtype=torch.bfloat16)
        ref = reference_linear(x.float(), module.dequantize_weight(torch.float32), module.bias)
        assert_close_to_reference(plain(x), ref, torch.bfloat16, folded=True)
        assert_close_to_reference(module(x), ref, torch.bfloat16, folded=granularity == "block")


def test_extra_repr_is_readable() -> None:
    text = repr(Fp8Linear.from_linear(_linear(37, 100), _config("static")))
    for part in ["in_features=37", "out_features=100", "bias=True", "scheme=static"]:
        assert part in text
    assert "weight=e4m3/row" in text and "activation=e4m3/tensor" in text
    assert "compute_dtype=torch.bfloat16" in text
    assert "weight-only" in repr(Fp8Linear.from_linear(_linear(8, 8), _config("weight_only")))


@pytest.mark.parametrize(("scheme", "granularity"), RECIPES)
def test_state_dict_round_trips_exactly(scheme, granularity) -> None:
    source = Fp8Linear.from_linear(_linear(300, 130), _config(scheme, granularity))
    state = source.state_dict()
    kwargs = source_kwargs(source)
    fresh = Fp8Linear(300, 130, dtype=torch.bfloat16, **kwargs)
    fresh.load_state_dict(state)
    assert_states_bit_equal(fresh.state_dict(), state)
    existing = Fp8Linear.from_linear(_linear(300, 130), _config(scheme, granularity))
    existing.load_state_dict(state)  # copy_ into live fp8 parameters
    assert_states_bit_equal(existing.state_dict(), state)
    assert not existing.weight.requires_grad
    x = torch.randn(3, 300, dtype=torch.bfloat16)
    assert torch.equal(existing(x), source(x)) and torch.equal(fresh(x), source(x))
    on_meta = Fp8Linear(300, 130, dtype=torch.bfloat16, device="meta", **kwargs)
    on_meta.load_state_dict(state, assign=True)
    assert_states_bit_equal(on_meta.state_dict(), state)
    assert not on_meta.weight.requires_grad
    assert torch.equal(on_meta(x), source(x))


def source_kwargs(module: Fp8Linear) -> dict:
    return {
        "activation_scheme": module.activation_scheme,
        "weight_granularity": module.weight_granularity,
        "activation_granularity": module.activation_granularity,
    }


def test_torch_save_and_load_weights_only() -> None:
    source = Fp8Linear.from_linear(_linear(37, 100), _config("static", "block"))
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert_states_bit_equal(state, source.state_dict())
    target = Fp8Linear(37, 100, dtype=torch.bfloat16, **source_kwargs(source))
    target.load_state_dict(state)
    assert_states_bit_equal(target.state_dict(), source.state_dict())


def test_high_precision_state_dict_is_refused() -> None:
    module = Fp8Linear(8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight is torch\.bfloat16, not fp8.*from_linear"):
        module.load_state_dict(nn.Linear(8, 4).to(torch.bfloat16).state_dict(), strict=False)


def test_deepcopy_and_to() -> None:
    module = Fp8Linear.from_linear(_linear(64, 32), _config("static"))
    clone = copy.deepcopy(module)
    assert_states_bit_equal(clone.state_dict(), module.state_dict())
    assert clone.weight.data_ptr() != module.weight.data_ptr()
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(clone(x), module(x))
    for convert, dtype in [
        (lambda m: m.to(torch.float32), torch.float32),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.to("cpu", torch.bfloat16), torch.bfloat16),
        (lambda m: m.float(), torch.float32),
    ]:
        moved = convert(copy.deepcopy(module))
        assert (
            moved.weight.dtype == torch.float8_e4m3fn and moved.weight_scale.dtype == torch.float32
        )
        assert moved.input_scale.dtype == torch.float32
        assert moved.compute_dtype == dtype and moved.bias.dtype == dtype
        assert_bit_equal(moved.weight, module.weight, "weight")
        assert moved(x.to(dtype)).dtype == dtype
    model = nn.Sequential(copy.deepcopy(module)).to(torch.float32)
    assert model[0].compute_dtype == torch.float32 and model[0].weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_meta_construction_then_to_empty_and_load(scheme) -> None:
    """The deferred-init route (accelerate's init_empty_weights, FSDP2): build on meta, even
    with a static scale, materialize with to_empty, fill from a state dict."""
    source = Fp8Linear.from_linear(_linear(64, 32), _config(scheme))
    extra = {"input_scale": 0.05} if scheme == "static" else {}
    kwargs = dict(activation_scheme=scheme, weight_granularity=source.weight_granularity)
    empty = Fp8Linear(64, 32, device="meta", dtype=torch.bfloat16, **kwargs, **extra)
    assert empty.weight.is_meta and (scheme == "dynamic" or empty.input_scale.is_meta)
    empty.to_empty(device="cpu")
    assert empty.weight.device.type == "cpu" and empty.weight.dtype == source.weight.dtype
    assert empty.weight_scale.dtype == torch.float32
    empty.load_state_dict(source.state_dict())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(empty(x), source(x))


def test_static_without_a_scale_says_how_to_get_one() -> None:
    module = Fp8Linear.from_linear(_linear(16, 8), Fp8Config("static"))
    assert module.input_scale is None
    with pytest.raises(RuntimeError, match=r"calibrate\(model, batches\).*activation_scale"):
        module(torch.randn(2, 16, dtype=torch.bfloat16))
    module.set_input_scale(0.01)
    assert module(torch.randn(2, 16, dtype=torch.bfloat16)).shape == (2, 8)


def test_input_scale_rules() -> None:
    with pytest.raises(ValueError, match="only used by activation_scheme='static'"):
        Fp8Linear(8, 4).set_input_scale(0.1)
    static = Fp8Linear(8, 4, activation_scheme="static")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            static.set_input_scale(bad)
    config = Fp8Config("static", activation_scale=0.5, activation_scales={"a.proj": 0.25})
    named = Fp8Linear.from_linear(_linear(8, 4), config, module_name="a.proj")
    other = Fp8Linear.from_linear(_linear(8, 4), config, module_name="b.proj")
    assert named.input_scale.item() == 0.25 and other.input_scale.item() == 0.5


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_raise_naming_the_module(bad) -> None:
    linear = _linear(16, 8)
    with torch.no_grad():
        linear.weight[3, 4] = bad
    with pytest.raises(ValueError, match=r"model\.mlp\.up_proj\.weight"):
        Fp8Linear.from_linear(linear, module_name="model.mlp.up_proj")


@pytest.mark.parametrize(("scheme", "granularity"), RECIPES)
def test_non_finite_activations_are_not_hidden(scheme, granularity) -> None:
    module = Fp8Linear.from_linear(_linear(64, 32), _config(scheme, granularity))
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    x[1, 2, 7] = float("nan")
    x[0, 1, 9] = float("inf")
    out = module(x)
    assert not bool(torch.isfinite(out[1, 2]).any()) and not bool(torch.isfinite(out[0, 1]).any())
    ok = torch.ones(2, 4, dtype=torch.bool)
    ok[1, 2] = ok[0, 1] = False
    assert bool(torch.isfinite(out[ok]).all())


def test_zero_weight_layer_outputs_its_bias() -> None:
    linear = _linear(32, 16)
    with torch.no_grad():
        linear.weight.zero_()
    module = Fp8Linear.from_linear(linear)
    assert bool(torch.isfinite(module.weight_scale).all())
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(module(x), linear.bias.expand(3, -1))


@pytest.mark.parametrize("scheme", ["weight_only", "dynamic"])
def test_adapter_style_training_gets_input_and_bias_gradients(scheme) -> None:
    """As under a LoRA adapter: activation grads flow, the fp8 weight stays frozen."""
    module = Fp8Linear.from_linear(_linear(64, 32, dtype=torch.float32), _config(scheme))
    x = torch.randn(2, 5, 64, requires_grad=True)
    out = module(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    w = module.dequantize_weight(torch.float32)
    torch.testing.assert_close(x.grad, grad_out @ w, rtol=1e-5, atol=1e-5)
    assert module.weight.grad is None and module.bias.grad is not None
    assert module.compute_dtype == torch.float32


def test_direct_construction_and_validation() -> None:
    module = Fp8Linear(37, 100, bias=False)
    assert module.weight.shape == (100, 37) and module.bias is None
    assert module.compute_dtype == torch.get_default_dtype()
    assert module.activation_granularity == "token"
    assert Fp8Linear(8, 8, weight_granularity="block").activation_granularity == "block"
    assert Fp8Linear(8, 8, activation_scheme="static").activation_granularity == "tensor"
    assert Fp8Linear(8, 8, activation_scheme="weight_only").activation_granularity is None
    with pytest.raises(ValueError, match="activation_scheme="):
        Fp8Linear(8, 8, activation_scheme="int4")
    with pytest.raises(ValueError, match="weight_granularity="):
        Fp8Linear(8, 8, weight_granularity="group")
    with pytest.raises(ValueError, match="fp8_format="):
        Fp8Linear(8, 8, fp8_format="e3m4")
    with pytest.raises(ValueError, match="kernel="):
        Fp8Linear(8, 8, kernel="cuda")


def test_direct_construction_fills_real_storage_only() -> None:
    """Zero weight, unit scale, zero bias on a real device; bare meta tensors on meta."""
    module = Fp8Linear(16, 8, dtype=torch.bfloat16)
    assert list(module.state_dict()) == ["weight", "weight_scale", "bias"]
    assert module.weight.dtype == torch.float8_e4m3fn
    assert not module.weight.view(torch.uint8).any()
    assert torch.equal(module.weight_scale, torch.ones(8, 1))
    assert torch.equal(module.bias, torch.zeros(8, dtype=torch.bfloat16))
    assert not module.weight.requires_grad and module.bias.requires_grad
    assert module.input_scale is None
    for on_meta in (Fp8Linear(16, 8, device="meta"), _meta_default_device_layer()):
        assert all(p.is_meta for p in on_meta.parameters())
        assert on_meta.weight_scale.shape == (8, 1) and on_meta.bias.dtype == torch.float32


def _meta_default_device_layer() -> Fp8Linear:
    with torch.device("meta"):
        return Fp8Linear(16, 8)


def test_e5m2_weights() -> None:
    linear = _linear(64, 32, dtype=torch.float32)
    module = Fp8Linear.from_linear(linear, Fp8Config("weight_only", fp8_format="e5m2"))
    assert module.weight.dtype == torch.float8_e5m2
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert sqnr_db(linear(x), module(x)) > 20


@pytest.mark.slow
def test_torch_compile_of_the_module_matches_eager(compiled) -> None:
    """Under the user's torch.compile the eager body is traced (no nested compile)."""
    module = Fp8Linear.from_linear(_linear(64, 48), _config("weight_only"))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = module(x)
        compiled_module = torch.compile(module)
        torch.testing.assert_close(compiled_module(x), eager, rtol=2**-7, atol=1e-3)


def test_from_linear_builds_the_module_on_the_meta_device(monkeypatch) -> None:
    """No throw-away high-precision or zero fp8 weight is allocated on the real device."""
    devices = []
    init = Fp8Linear.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        devices.append(self.weight.device.type)

    monkeypatch.setattr(Fp8Linear, "__init__", spy)
    module = Fp8Linear.from_linear(_linear(64, 32))
    assert devices == ["meta"] and module.weight.device.type == "cpu"


def test_tensor_wise_state_dict_with_scalar_scales_loads() -> None:
    """0-dim scales are the AutoFP8 / vLLM 'fp8' layout (DESIGN.md §5)."""
    source = Fp8Linear.from_linear(_linear(16, 8), _config("static", "tensor"))
    state = {k: v.reshape(()) if k.endswith("scale") else v for k, v in source.state_dict().items()}
    target = Fp8Linear(16, 8, dtype=torch.bfloat16, **source_kwargs(source))
    target.load_state_dict(state)
    assert_states_bit_equal(target.state_dict(), source.state_dict())


def test_input_scale_of_a_dynamic_layer_is_an_unexpected_key() -> None:
    source = Fp8Linear.from_linear(_linear(16, 8), _config("static", "tensor"))
    target = Fp8Linear(
        16, 8, dtype=torch.bfloat16, activation_scheme="dynamic", weight_granularity="tensor"
    )
    with pytest.raises(RuntimeError, match="input_scale"):
        target.load_state_dict(source.state_dict())


@pytest.mark.slow  # ~24 inductor compiles on a cold cache (about 1 CPU-minute)
@pytest.mark.parametrize(("scheme", "granularity"), RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_grid_with_the_default_compiled_helpers(
    compiled, monkeypatch, scheme, granularity, dtype
) -> None:
    """The same grid as test_forward_matches_the_reference through the inductor-compiled
    helpers (the default outside the tests), which must actually run: a silent fallback to
    the eager twin fails here."""
    from hf_fp8.kernels import compiled as compiled_module

    ran = []
    real = compiled_module._compiled
    monkeypatch.setattr(compiled_module, "_compiled", lambda *a: ran.append(a) or real(*a))
    monkeypatch.setenv("HF_FP8_CPU_KERNEL", "off")  # the compiled emulation, not the C kernels
    k, n = 37, 100
    module = Fp8Linear.from_linear(_linear(k, n, True, dtype), _config(scheme, granularity))
    for shape in [(5, k), (2, 3, k), (1, k)]:
        x = torch.randn(shape).to(dtype)
        with torch.no_grad():
            out = module(x)
        assert out.shape == (*shape[:-1], n) and out.dtype == dtype
        ref = _expected(module, x)
        assert_close_to_reference(out.reshape(-1, n), ref, dtype, folded=granularity == "block")
    assert ran, "the compiled helpers did not run"
    assert not compiled_module._FAILED, "a helper failed to compile and fell back to eager"
