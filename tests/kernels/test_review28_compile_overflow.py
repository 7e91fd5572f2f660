"""R28 B: huge finite activations through a *compiled* emulated FP8 linear.

The eager emulation redoes a post-scaled product (unscaled fp8 codes times the activation)
with folded scales when its output is not finite (R24 F2), but the check was skipped under
``torch.compile``: the compiled layer gave +-inf where eager and the float64 dequantized
product are finite. The check now runs as a ``torch.cond`` (no graph break: ``fullgraph``).
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel
from tests.kernels.test_review24_overflow import _layer, _reference


@pytest.mark.parametrize("m", [1, 40])  # the emulation's GEMV, its post-scaled matmul
def test_compiled_emulation_stays_finite(monkeypatch, m) -> None:
    monkeypatch.setenv(cpu_kernel.ENV, "off")
    torch._dynamo.reset()
    layer = _layer("weight_only", "row", None, torch.bfloat16)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(4))
    x[:, 5] = 1e37
    x = x.to(torch.bfloat16)
    y = torch.randn(m, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        out = compiled(x)
        normal, normal_eager = compiled(y), layer(y)
    ref, terms = _reference(layer, x, None)
    assert bool(ref.isfinite().all()) and float(ref.abs().max()) > 1e30
    assert bool(out.isfinite().all()), f"{int((~out.isfinite()).sum())} non-finite outputs"
    assert bool(((out.double() - ref).abs() <= 2.0**-7 * (ref.abs() + terms)).all())
    # normal inputs: the compiled layer as close to float64 as the eager one
    ref_y, terms_y = _reference(layer, y, None)
    for o in (normal, normal_eager):
        assert bool(((o.double() - ref_y).abs() <= 2.0**-7 * (ref_y.abs() + terms_y)).all())
