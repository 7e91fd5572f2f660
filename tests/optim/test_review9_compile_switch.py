"""``HF_FP8_COMPILE=0`` ("no inductor") also holds for ``AdamWFp8`` (R13 3).

Where the C kernel cannot run (fp16 parameters here), ``implementation="auto"`` fell back to
``torch.compile`` of the reference step even with ``HF_FP8_COMPILE=0``: a ~20 s first step and
an inductor compile the switch promises not to do. Reference: ``implementation="reference"``.
"""

from __future__ import annotations

import warnings

import torch

from hf_fp8.optim import AdamWFp8


def _steps(implementation: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 128, dtype=torch.float16))
    opt = AdamWFp8([p], lr=1e-2, min_quantize_numel=0, implementation=implementation)
    for step in range(3):
        p.grad = torch.randn(8, 128, generator=torch.Generator().manual_seed(step)).half()
        opt.step()
    state = opt.state[p]
    return [p.detach().clone(), *(v.clone() for v in state.values() if torch.is_tensor(v))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def test_auto_does_not_compile_when_the_switch_is_off(monkeypatch):
    monkeypatch.setenv("HF_FP8_COMPILE", "0")
    calls = []
    want = _steps("reference")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a) or (lambda *x: None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _steps("auto")  # fp16 parameters: the C kernel cannot run
    assert calls == []
    assert not [w for w in caught if "compile" in str(w.message)]
    assert len(got) == len(want) >= 3  # the parameter, codes and scales of both moments
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_auto_still_compiles_when_the_switch_is_on(monkeypatch):
    """The switch is what decides: with it on, the fallback is still torch.compile."""
    monkeypatch.setenv("HF_FP8_COMPILE", "1")
    calls = []

    def fake_compile(fn, *args, **kwargs):
        calls.append(fn)
        return fn  # the eager step itself: same results, no inductor

    want = _steps("reference")
    monkeypatch.setattr(torch, "compile", fake_compile)
    got = _steps("auto")
    assert len(calls) == 1
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))
