"""R38 F1b: a static layer given an +-inf token must not redo the product.

The overflow redo (R24 F2, R28 C) runs a post-scaled product again with the scales folded
into the operands, but only where a non-finite output row comes from a finite input row:
a non-finite input row gives the same non-finite output on the folded route. For static
scales the emulation (and the ``torch.func`` route) still counted +-inf as a finite input,
on the stale assumption that static scales saturate inf; ``numerics.quantize_with_scale``
turns it into NaN, so one inf token redid the whole batch, gaining nothing and changing the
other tokens' bits. References: the same batch with the token finite, and the float64
dequantized product (NaN for the inf token, as ``saturated_cast`` gives).
"""

from __future__ import annotations

import pytest
import torch

import hf_fp8
from hf_fp8.kernels import cpu_kernel, emulated
from hf_fp8.modules.fp8_linear import Fp8Linear


@pytest.fixture
def emulation(monkeypatch) -> list[bool]:
    """The emulation (C kernels off); records every ``_mm`` call's ``post`` flag."""
    monkeypatch.setenv(cpu_kernel.ENV, "off")
    calls: list[bool] = []
    real = emulated._mm
    monkeypatch.setattr(emulated, "_mm", lambda *a: calls.append(a[-1]) or real(*a))
    return calls


def _static_layer(dtype: torch.dtype) -> Fp8Linear:
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(256, 64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 256, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(64, generator=gen) * 0.1)
    return Fp8Linear.from_linear(lin.to(dtype), hf_fp8.Fp8Config("static", activation_scale=0.01))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
@pytest.mark.parametrize("m", [3, 5])  # the emulation's GEMV (<= 4 tokens) and its matmul
def test_inf_token_of_a_static_layer_is_not_redone(emulation, bad, m) -> None:
    layer = _static_layer(torch.bfloat16)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        clean = layer(x)
        y = x.clone()
        y[0, 7] = bad
        emulation.clear()
        out = layer(y)
    # the float64 reference: the static quantization turns +-inf into a NaN code
    assert bool(out[0].isnan().all())
    assert len(emulation) <= 1, f"a folded redo ran for an inf input: {emulation}"
    assert torch.equal(out[1:], clean[1:]), (
        f"{int((out[1:] != clean[1:]).sum())} outputs of the other tokens changed"
    )


def test_redo_helps_takes_no_nan_only_flag() -> None:
    """``cpu_kernel.redo_helps`` judges finite rows only (NaN and +-inf alike)."""
    out = torch.tensor([[float("nan")], [1.0]])
    a = torch.tensor([[float("inf"), 1.0], [1.0, 1.0]])
    assert not cpu_kernel.redo_helps(out, a, None)
    with pytest.raises(TypeError):
        cpu_kernel.redo_helps(out, a, None, nan_only=True)
