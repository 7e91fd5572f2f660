"""Reviewer R17 finding F1: since finite activations saturate where ``x / scale`` overflows
(d781450), a zero input scale (``x / 0 = ±inf`` from a finite ``x``) saturated too, so a
zero or negligible static scale gave all-zero layer outputs, silently, where it gave NaN
before. ``Fp8Experts.load_state_dict`` also took any input scale (``0``, ``1e-45``).

Now ``Fp8Experts.load_state_dict`` checks its ``[E]`` input scales as ``Fp8Linear`` does
(finite, ``>= min_input_scale``, ``<= max_scale``), and, as defence in depth, a scale that is
not ``> 0`` (zero, negative, NaN) quantizes every value to NaN in the emulation, its compiled
form and every C path alike. Reference: with such a scale there is no fp8 value to compute,
so every output is NaN (visible), never a finite number."""

from __future__ import annotations

import pytest
import torch

from hf_fp8 import Fp8Config, Fp8Linear
from hf_fp8.kernels import cpu_kernel, emulated
from hf_fp8.modules.fp8_experts import Fp8Experts
from hf_fp8.numerics import amax_to_scale, quantize_with_scale
from hf_fp8.numerics.checks import CheckpointTensorError
from tests.modules.moe_zoo import build_tiny, experts_classes, routed_inputs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {"e4m3": E4M3, "e5m2": E5M2}
BAD = [0.0, -0.0, -0.05, float("nan")]
C_PATHS = [p for p in cpu_kernel.supported_paths() if cpu_kernel.library(p) is not None]
NAN, INF = float("nan"), float("inf")
QWEN3 = next(c for c in experts_classes() if c.__name__ == "Qwen3MoeExperts")


def _scale(granularity: str, value: float, rows: int, cols: int, bk: int) -> torch.Tensor:
    shape = {"tensor": (1,), "row": (rows, 1), "block": (rows, -(-cols // bk))}[granularity]
    return torch.full(shape, value)


@pytest.mark.parametrize("fmt", sorted(FMT))
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("bad", BAD)
def test_a_scale_that_is_not_positive_gives_nan_everywhere(fmt, granularity, bad):
    x = torch.tensor([[1.0, -2.0, 0.0, 3.0, 1e38, -1e-3, float("inf"), 0.5]])
    got = quantize_with_scale(x, _scale(granularity, bad, 1, 8, 4), FMT[fmt], granularity, (1, 4))
    assert bool(got.float().isnan().all()), got.float().tolist()


def test_only_the_bad_groups_give_nan():
    """Row / block scales: a bad group's values are NaN, the others quantize as before."""
    x = torch.randn(3, 8)
    good = amax_to_scale(x.abs().amax(dim=-1, keepdim=True), E4M3)
    scale = good.clone()
    scale[1] = 0.0
    got = quantize_with_scale(x, scale, E4M3, "row").float()
    want = (x / good).clamp(-448, 448).to(E4M3).float()
    assert bool(got[1].isnan().all())
    assert torch.equal(got[[0, 2]], want[[0, 2]])


@pytest.mark.skipif(not C_PATHS, reason="no C kernel builds here")
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("fmt", sorted(FMT))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", BAD)
def test_c_kernel_gives_nan_for_a_scale_that_is_not_positive(path, fmt, x_dtype, bad):
    """67 columns: the 32 / 16-lane vector loops and the scalar tail; same as the emulation."""
    x = (torch.randn(3, 67) * 0.1).to(x_dtype)
    x[0, 0] = 0.0
    for out_dtype in (torch.float32, torch.bfloat16):
        for post in (True, False):
            got, _ = cpu_kernel.quantize_activation(
                x, torch.tensor([bad]), FMT[fmt], "tensor", 1, out_dtype, post, path
            )
            assert bool(got.float().isnan().all()), (out_dtype, post)
            emu, _ = emulated._fake_quant_act(
                x, torch.tensor([bad]), act_dtype=FMT[fmt], gran="tensor", bk=1,
                out_dtype=out_dtype, post=post,
            )  # fmt: skip
            torch.testing.assert_close(got, emu, rtol=0, atol=0, equal_nan=True)


def _zero_scale_linear(dtype: torch.dtype, fmt: str = "e4m3") -> Fp8Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, bias=True).to(dtype)
    layer = Fp8Linear.from_linear(
        linear, Fp8Config("static", fp8_format=fmt, activation_scale=0.05)
    )
    layer.input_scale.data.zero_()  # past every check: what the kernels do with it
    return layer


@pytest.mark.parametrize("kernel_env", ["off", *C_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 40])  # the GEMV; the (fused) matmul past 16 tokens
def test_fp8_linear_with_a_zero_input_scale_gives_nan_not_zeros(
    kernel_env, dtype, tokens, monkeypatch
):
    monkeypatch.setenv(cpu_kernel.ENV, kernel_env)
    layer = _zero_scale_linear(dtype)
    with torch.no_grad():
        got = layer(torch.randn(tokens, 64).to(dtype))
    assert bool(got.isnan().all())


def test_the_inductor_compiled_emulation_gives_nan_too(monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV, "off")
    monkeypatch.setenv("HF_FP8_COMPILE", "1")
    layer = _zero_scale_linear(torch.bfloat16)
    with torch.no_grad():
        got = layer(torch.randn(3, 64).to(torch.bfloat16))
    assert bool(got.isnan().all())


def _experts(activation_scale: float = 0.02) -> tuple[torch.nn.Module, Fp8Experts]:
    source = build_tiny(QWEN3, dtype=torch.float32)
    return source, Fp8Experts.from_experts(
        source, Fp8Config("static", activation_scale=activation_scale)
    )


@pytest.mark.parametrize("kernel_env", ["off", *C_PATHS[:1]])
def test_fp8_experts_with_a_zero_input_scale_give_nan_not_zeros(kernel_env, monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV, kernel_env)
    _, fp8 = _experts()
    fp8.gate_up_proj_input_scale.data.zero_()
    x, index, weights = routed_inputs(fp8.layout.hidden_size, fp8.layout.num_experts, tokens=9)
    with torch.no_grad():
        got = fp8(x, index, weights)
    assert bool(got.isnan().all())


BAD_SCALES = [
    *(("down_proj_input_scale", v) for v in (1e-45, 1e-20, 0.0, -1.0, NAN, INF, 1e38)),
    # a zero weight scale loaded through load_state_dict gave silent all-zero expert outputs
    # (from_pretrained checks it; load_state_dict did not): refused like Fp8Linear's
    *(("down_proj_weight_scale", v) for v in (0.0, -1.0, NAN, INF, 1e38)),
]


@pytest.mark.parametrize(("key", "bad"), BAD_SCALES)
def test_fp8_experts_load_state_dict_refuses_a_bad_scale_naming_it(key, bad):
    _, fp8 = _experts()
    state = {k: v.clone() for k, v in fp8.state_dict().items()}
    state[key].view(-1)[1] = bad
    _, fresh = _experts()
    before = getattr(fresh, key).clone()
    with pytest.raises(CheckpointTensorError, match=key):
        fresh.load_state_dict(state)
    assert torch.equal(getattr(fresh, key), before)  # nothing changed


def test_fp8_experts_load_state_dict_refuses_a_wrong_input_scale_shape():
    _, fp8 = _experts()
    state = dict(fp8.state_dict())
    state["gate_up_proj_input_scale"] = torch.tensor([0.02])
    with pytest.raises(CheckpointTensorError, match=r"gate_up_proj_input_scale.*shape"):
        fp8.load_state_dict(state)


def test_fp8_experts_load_the_smallest_accepted_scale_and_match_its_reference():
    """The bound itself (what calibration stores for an amax of 1e-12) loads, and the layer
    gives what a module built with that scale gives."""
    low = float(amax_to_scale(torch.tensor([1e-12]), E4M3))
    _, want_module = _experts(activation_scale=low)
    _, fp8 = _experts()
    state = {k: v.clone() for k, v in want_module.state_dict().items()}
    prefixed = {f"experts.{k}": v for k, v in state.items()}
    holder = torch.nn.Module()
    holder.experts = fp8
    holder.load_state_dict(prefixed)
    assert torch.equal(fp8.gate_up_proj_input_scale, want_module.gate_up_proj_input_scale)
    x, index, weights = routed_inputs(fp8.layout.hidden_size, fp8.layout.num_experts, tokens=5)
    with torch.no_grad():
        assert torch.equal(fp8(x, index, weights), want_module(x, index, weights))


def test_fp8_experts_load_state_dict_takes_a_valid_weight_scale():
    _, want = _experts()
    _, fresh = _experts(activation_scale=0.5)
    fresh.load_state_dict(want.state_dict())
    x, index, weights = routed_inputs(want.layout.hidden_size, want.layout.num_experts, tokens=5)
    with torch.no_grad():
        assert torch.equal(fresh(x, index, weights), want(x, index, weights))
