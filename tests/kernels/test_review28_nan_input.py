"""R28 C: a NaN / inf *input* no longer makes every CPU call run twice.

Since R24 F1 / F2 a product whose output is not finite is redone with the scales folded into
the operands (a huge finite activation may have overflowed the unscaled-code sums). A
non-finite activation row gives a non-finite output row on the folded route too, so the redo
only cost time (3.4-5.4x at one token, 4096 x 4096). Now it runs only where some non-finite
output row comes from a finite input row; a batch mixing a NaN row and a huge finite row
still has its finite row fixed (float64 dequantized reference).
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel, emulated
from tests.kernels.test_review24_overflow import _layer, _reference


@pytest.fixture(params=["native", "off"])
def route(request, monkeypatch) -> str:
    if request.param == "native" and cpu_kernel.active_path() is None:
        pytest.skip("no C kernel builds here")
    if request.param == "off":
        monkeypatch.setenv(cpu_kernel.ENV, "off")
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    return request.param


def _spy(monkeypatch, route: str) -> list[int]:
    """Records the folded redos: the C GEMV's, or the emulation's (``_mm`` after its GEMV)."""
    calls: list[int] = []
    if route == "off":
        real = emulated._mm
        monkeypatch.setattr(emulated, "_mm", lambda *a: calls.append(1) or real(*a))
    else:
        real = cpu_kernel._folded_fp32
        monkeypatch.setattr(cpu_kernel, "_folded_fp32", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_not_redone(route, monkeypatch, dtype, bad) -> None:
    layer = _layer("weight_only", "row", None, dtype)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[0, 7] = bad
    calls = _spy(monkeypatch, route)
    with torch.no_grad():
        out = layer(x)
    assert not bool(out.isfinite().any())  # as the float64 reference: NaN / inf everywhere
    # one token: the GEMV (C, or the emulation's), and no folded redo after it
    assert calls == [], f"{len(calls)} folded redo(s) of a non-finite input"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_row_next_to_a_huge_finite_row(route, dtype) -> None:
    layer = _layer("weight_only", "row", None, dtype)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(3))
    x[0, 7] = float("nan")
    x[1, 5] = 1e37
    x = x.to(dtype)
    with torch.no_grad():
        out = layer(x)
    ref, terms = _reference(layer, x, None)
    assert bool(out[0].isnan().all()) and bool(ref[0].isnan().all())
    assert bool(ref[1].isfinite().all()) and float(ref[1].abs().max()) > 1e30
    assert bool(out[1].isfinite().all()), out[1]
    r = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-16
    assert bool(((out[1].double() - ref[1]).abs() <= r * (ref[1].abs() + terms[1])).all())
