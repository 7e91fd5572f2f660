"""R25 F7: an FP8 linear's output is a fresh tensor, not a view, as ``nn.Linear``'s 2-D
output is. FSDP2 warns for a module output that is a view ("returned a view tensor. An
in-place op on this view ... will silently drop the pre-backward hook"): every Fp8Linear is
its own FSDP2 module under ``hf_fp8.fully_shard_fp8``, and a model that writes
``out += residual`` after it would lose that hook. Checked on every CPU route (C kernels on
and off, GEMV token counts and the decode + matmul path, each scheme, with and without
autograd), 3-D inputs too (nn.Linear returns a view there; the FP8 layer need not)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_fp8 import Fp8Config
from hf_fp8.kernels import cpu_kernel
from hf_fp8.modules import Fp8Linear

SCHEMES = {
    "weight_only": Fp8Config("weight_only"),
    "dynamic_token": Fp8Config("dynamic"),
    "dynamic_tensor": Fp8Config("dynamic", activation_granularity="tensor"),
    "static_tensor_w": Fp8Config("static", weight_granularity="tensor", activation_scale=0.02),
    "dynamic_block": Fp8Config("dynamic", weight_granularity="block", block_size=(32, 32)),
}


def _layer(config: Fp8Config, dtype: torch.dtype) -> tuple[Fp8Linear, nn.Linear]:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    return Fp8Linear.from_linear(linear, config), linear


@pytest.mark.parametrize("cpu_path", ["off", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_two_d_output_is_not_a_view(monkeypatch, cpu_path, dtype, tokens, scheme):
    monkeypatch.setenv(cpu_kernel.ENV, cpu_path)
    fp8, linear = _layer(SCHEMES[scheme], dtype)
    x = torch.randn(tokens, 64, dtype=dtype)
    assert linear(x)._base is None  # what nn.Linear does
    with torch.no_grad():
        out = fp8(x)
    assert out._base is None and not out._is_view()
    assert out.shape == (tokens, 48)
    x_grad = x.clone().requires_grad_(True)
    out = fp8(x_grad)
    assert out._base is None and not out._is_view()
    # 3-D: nn.Linear's output is a view here; the FP8 layer's is not
    out3 = fp8(x.reshape(1, tokens, 64))
    assert out3._base is None and out3.shape == (1, tokens, 48)
    torch.testing.assert_close(out3[0], fp8(x), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_in_place_add_after_the_layer_keeps_gradients(scheme):
    """``out += residual`` on the output, then backward: the input and bias gradients are
    the straight-through ones (dequantized weight), in fp32."""
    fp8, _ = _layer(SCHEMES[scheme], torch.float32)
    w = fp8.dequantize().weight.detach()
    x = torch.randn(5, 2, 64, requires_grad=True)
    residual = torch.randn(5, 2, 48)
    out = fp8(x)
    out += residual
    (out * out).sum().backward()
    grad_out = 2 * out.detach()
    torch.testing.assert_close(x.grad, grad_out @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8.bias.grad, grad_out.sum((0, 1)), rtol=1e-5, atol=1e-5)
