"""The fused decode + GEMM (``fp8_mm_bf16``, the ``avx512bf16`` path) for many bf16 tokens.

Shapes cross every blocking edge of the kernel: K over several K blocks and not a multiple
of 32, N over several row chunks with a partial 32-row panel, M over a token block with
uneven token tiles. References: the float64 product of the exact operands (the bound of
tests/kernels/test_cpu_kernel.py for the bf16 matmul: one bf16 rounding of the product,
one of the result, fp32 reassociation, block scales folded into bf16) and the tiled
decode + ``F.linear`` path it replaces (``FUSED_MM = False``), within twice that bound.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel, emulated
from tests.kernels.test_cpu_kernel import (
    BLOCK,
    FORMATS,
    SCHEMES,
    _activation,
    _all_codes_weight,
    _bound,
    _expand64,
    _problem,
    _weight_scale,
)

PATH = "avx512bf16"
pytestmark = pytest.mark.skipif(
    PATH not in cpu_kernel.supported_paths() or cpu_kernel.library(PATH) is None,
    reason="the fused matmul runs on the avx512bf16 path only",
)


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV, PATH)
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", True)
    calls = []
    real = cpu_kernel.fused_mm
    monkeypatch.setattr(cpu_kernel, "fused_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _run(x, w8, ws, bias, gran, kwargs, monkeypatch, use_fused: bool):
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", use_fused)
    return emulated.emulated_linear(x, w8, ws, bias, gran, BLOCK, **kwargs)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
@pytest.mark.parametrize(("m", "k", "n"), [(17, 1100, 75), (270, 96, 40), (33, 64, 1100)])
def test_fused_matches_float64_and_the_tiled_path(fused, monkeypatch, fmt, gran, m, k, n):
    dtype = FORMATS[fmt]
    w8, ws, w64, bias, x = _problem(fmt, gran, m, k, n)
    for scheme in SCHEMES:
        a64, kwargs = _activation(x, scheme, dtype)
        ref = a64 @ w64.T + bias.double()
        blocky = 2.0**-8 if "block" in (gran, SCHEMES[scheme][0]) else 0.0
        before = len(fused)
        out = _run(x, w8, ws, bias, gran, kwargs, monkeypatch, True)
        assert len(fused) == before + 1, "the fused kernel did not run"
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        bound = _bound(a64, w64, ref, 2.0**-8, 2.0**-16 + blocky) + 2.0**-8 * (a64 @ w64.T).abs()
        err = (out.double() - ref).abs()
        assert bool((err <= bound).all()), f"{scheme}: {float((err / bound).max()):.2f}x bound"
        tiled = _run(x, w8, ws, bias, gran, kwargs, monkeypatch, False)
        assert len(fused) == before + 1, "FUSED_MM = False still ran the fused kernel"
        diff = (out.double() - tiled.double()).abs()
        assert bool((diff <= 2 * bound).all()), f"{scheme} vs the tiled path"


def test_odd_k_takes_the_tiled_path(fused, monkeypatch):
    w8 = _all_codes_weight(40, 77, torch.float8_e4m3fn)
    ws = _weight_scale(40, 77, "row")
    x = torch.randn(24, 77).to(torch.bfloat16)
    out = _run(x, w8, ws, None, "row", {}, monkeypatch, True)
    assert not fused
    ref = x.double() @ (w8.double() * ws.double()).T
    assert float(((out.double() - ref).abs() / (ref.abs() + 1e-3)).max()) < 2**-6


def test_nan_code_and_subnormal_codes(fused, monkeypatch):
    """A NaN weight code poisons its output column only; subnormal codes multiply exactly
    (no flush to zero: every fp8 value is a normal bf16 number)."""
    w8 = torch.zeros(64, 96, dtype=torch.uint8)
    w8[:, :8] = torch.arange(8, dtype=torch.uint8)  # E4M3 subnormals 0 .. 7 * 2**-9
    w8[5, 40] = 0x7F  # NaN
    w8 = w8.view(torch.float8_e4m3fn)
    ws = torch.ones(64, 1)
    x = torch.zeros(20, 96, dtype=torch.bfloat16)
    x[:, :8] = 1.0
    out = _run(x, w8, ws, None, "row", {}, monkeypatch, True)
    assert fused
    want = float(sum(range(8))) * 2.0**-9
    nan = torch.zeros(20, 64, dtype=torch.bool)
    nan[:, 5] = True
    assert torch.equal(out.isnan(), nan)
    assert bool((out[:, [c for c in range(64) if c != 5]].float() == want).all())


def test_threads_do_not_change_a_bit(fused, monkeypatch):
    """Threads split whole panels of MM_MR weight rows: each output is one thread's sum, in one order."""
    w8 = _all_codes_weight(700, 1030, torch.float8_e4m3fn)
    ws = _weight_scale(700, 1030, "row")
    x = torch.randn(40, 1030).to(torch.bfloat16)
    saved = torch.get_num_threads()
    lib = cpu_kernel.library(PATH)
    outs = []
    try:
        for threads, openmp in ((1, True), (2, True), (2, False)):
            torch.set_num_threads(threads)
            lib.fp8_set_openmp(cpu_kernel._torch_openmp() if openmp else None)
            outs.append(_run(x, w8, ws, None, "row", {}, monkeypatch, True))
    finally:
        torch.set_num_threads(saved)
        lib.fp8_set_openmp(cpu_kernel._torch_openmp())
    assert len(fused) == 3
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_amx_machines_keep_onednn(monkeypatch):
    """With AMX, oneDNN's bf16 matmul is faster than any vdpbf16ps GEMM: auto keeps it."""
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", None)
    monkeypatch.setattr(cpu_kernel, "cpu_features", lambda: frozenset({"amx_bf16"}))
    assert not cpu_kernel.fused_mm_enabled(PATH)
    monkeypatch.setattr(cpu_kernel, "cpu_features", lambda: frozenset({"avx512bf16"}))
    assert cpu_kernel.fused_mm_enabled(PATH)
    assert not cpu_kernel.fused_mm_enabled("avx512")


def test_out_writes_rows_of_a_larger_tensor(monkeypatch):
    """``fused_mm(..., out=big[a:b])`` writes those rows only, bit-equal to a fresh result;
    an out with other strides is refused before the C call."""
    monkeypatch.setenv(cpu_kernel.ENV, PATH)
    w8 = _all_codes_weight(50, 64, torch.float8_e4m3fn)
    ws = _weight_scale(50, 64, "row").reshape(-1).contiguous()
    a = torch.randn(20, 64).to(torch.bfloat16)
    args = (a, w8, ws, None, None, "row", 1, 1, True, PATH)
    fresh = cpu_kernel.fused_mm(*args)
    big = torch.full((30, 50), 7.0, dtype=torch.bfloat16)
    got = cpu_kernel.fused_mm(*args, out=big[5:25])
    assert got.data_ptr() == big[5:25].data_ptr()
    assert torch.equal(big[5:25], fresh)
    assert bool((big[:5] == 7).all()) and bool((big[25:] == 7).all())
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_kernel.fused_mm(*args, out=torch.empty(50, 20, dtype=torch.bfloat16).t())


@pytest.mark.parametrize("use_fused", [True, False])
@pytest.mark.parametrize("m", [17, 37])
def test_bias_is_added_before_the_one_rounding(monkeypatch, use_fused, m):
    """Found by review: with the weight scales folded into the decoded weight (block scales in
    bf16, weight-only) and a bias, the C paths rounded the product to bf16, added the bias and
    rounded again; the emulation (``F.linear(a, w, bias)``) adds the bias to the fp32 sum and
    rounds once. 469 of 1665 outputs differed; now bit for bit (K <= 1024: one K block)."""
    monkeypatch.setenv(cpu_kernel.ENV, PATH)
    torch.manual_seed(0)
    n, k, bs = 45, 130, (16, 64)
    w8 = (torch.randn(n, k) * 3).to(torch.float8_e4m3fn)
    ws = torch.rand(-(-n // bs[0]), -(-k // bs[1])) + 0.1
    x, bias = torch.randn(m, k).bfloat16(), torch.randn(n).bfloat16()
    ref = emulated._mm_forward(
        x, w8, ws, bias, None, w_gran="block", block_size=bs, act_dtype=None, a_gran=None,
        w_post=False, a_post=False,
    )  # fmt: skip
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", use_fused)
    got = emulated.emulated_linear(x, w8, ws, bias, "block", bs)
    assert int((got != ref).sum()) == 0


def test_fused_mm_refuses_what_the_kernel_cannot_read(monkeypatch):
    """Found by review: the public ``fused_mm`` let an activation of the wrong width (the C
    code reads M x K values: out of bounds), a 3-D activation, and block weight scales
    applied after the matmul (read as row scales: 28 % error) through without an error."""
    w = torch.randn(64, 256).to(torch.float8_e4m3fn)
    rows = torch.ones(64)
    cases = [
        (torch.randn(3, 8).bfloat16(), rows, "row", (1, 1), True, r"\[M >= 1, 256\]"),
        (torch.randn(2, 256, 5).bfloat16(), rows, "row", (1, 1), True, r"\[M >= 1, 256\]"),
        (torch.randn(20, 256).bfloat16(), torch.ones(64), "block", (2, 128), True, "w_post"),
    ]
    for a, ws, gran, (bn, bk), post, message in cases:
        with pytest.raises(ValueError, match=message):
            cpu_kernel.fused_mm(a, w, ws, None, None, gran, bn, bk, post, PATH)
    buf = torch.randn(4 * 256 + 4 * 64).bfloat16()
    a, out = buf[: 4 * 256].view(4, 256), buf[512 : 512 + 4 * 64].view(4, 64)
    with pytest.raises(ValueError, match="overlap"):
        cpu_kernel.fused_mm(a, w, rows, None, None, "row", 1, 1, True, PATH, out=out)


def _exact_weight(n: int, k: int, fmt: torch.dtype) -> torch.Tensor:
    """fp8 weights whose values are small multiples of 1/4: every product and every fp32
    partial sum below is exact, so any summation order gives the same bits."""
    values = torch.tensor([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    signs = torch.randint(0, 2, (n, k)) * 2 - 1
    return (values[torch.randint(0, len(values), (n, k))] * signs).to(fmt)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        # 2 token blocks (256 + 44: a last tile of 16), 3 K blocks of 704, 704, 642 codes
        # (the next panel of the last block is a longer one), 3 row chunks (224 + 224 + 47:
        # a last panel of 5 rows)
        (300, 2050, 495),
        # one token block packed by all threads together (shared, on first use), 3 K blocks
        (250, 2050, 230),
        (40, 130, 30),  # one K block, one panel of 14 + one of 2 rows
        (33, 4, 29),  # K shorter than one decoded 64-code piece
        # a last panel of 12 rows (the 14-row micro-kernel; the 5 and 2 rows above take
        # the 8- and 4-row ones)
        (20, 64, 54),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_is_exact_across_blocking_edges(fused, monkeypatch, fmt, gran, m, k, n, threads):
    """Exact operands (sums of small multiples of 1/4 times small integers; power-of-two
    scales): the fused kernel, whose weight panels are decoded ahead inside the previous
    panel's last token tile, must give the bits of the exact product, at 1 and 2 threads,
    wherever a token, K or row block ends."""
    dtype = FORMATS[fmt]
    w8 = _exact_weight(n, k, dtype)
    shape = {"tensor": (1,), "row": (n, 1), "block": (-(-n // BLOCK[0]), -(-k // BLOCK[1]))}
    ws = 2.0 ** torch.randint(-3, 4, shape[gran]).float()
    x = torch.randint(-3, 4, (m, k)).to(torch.bfloat16)
    w64 = w8.double() * _expand64(ws, n, k, gran, BLOCK)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = _run(x, w8, ws, None, gran, {}, monkeypatch, True)
    finally:
        torch.set_num_threads(saved)
    assert fused, "the fused kernel did not run"
    if gran == "block":  # the scale is folded into the decoded weight: one rounding
        ref = (x.double() @ w64.T).to(torch.bfloat16)
    else:  # the emulation rounds the unscaled product, then scales and rounds again
        acc = (x.double() @ w8.double().T).to(torch.bfloat16).double()
        ref = (acc * ws.double().reshape(1, -1)).to(torch.bfloat16)
    assert torch.equal(out, ref), f"{int((out != ref).sum())} of {out.numel()} outputs differ"


def _two_step(x, w8, ws, scale, gran, act, qgran, threads):
    """(in-kernel, two-step) outputs of the fused kernel at ``threads`` threads: ``x``
    quantized inside it, and ``quantize_activation`` followed by the fused matmul with its
    scales as the post scales."""
    post = gran == "row"
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        args = (w8, ws, scale, None, gran, *BLOCK, post, PATH)
        got = cpu_kernel.fused_mm(x, *args, quantize=FORMATS[act], quantize_gran=qgran)
        a, s = cpu_kernel.quantize_activation(
            x, scale, FORMATS[act], qgran, 1, torch.bfloat16, True, PATH
        )
        want = cpu_kernel.fused_mm(a, w8, ws, s.reshape(-1), None, gran, *BLOCK, post, PATH)
    finally:
        torch.set_num_threads(saved)
    return got, want


# 2 token blocks (each thread quantizes for itself) or one (the threads quantize and pack it
# together), 3 token blocks with a last one of 17, K over 3 K blocks, K not a multiple of
# 32 (a masked last piece of pairs), K = 2, a single token, partial last 16 tokens
DYNAMIC_SHAPES = [
    (300, 2050, 61),
    (250, 2050, 230),
    (17, 96, 40),
    (40, 130, 30),
    (529, 34, 20),
    (1, 66, 9),
    (19, 2, 5),
]


@pytest.mark.parametrize("act", sorted(FORMATS))
@pytest.mark.parametrize("gran", ["row", "block"])
@pytest.mark.parametrize("qgran", ["row", "tensor"])
@pytest.mark.parametrize(("m", "k", "n"), DYNAMIC_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_in_kernel_dynamic_quantization_is_the_two_step_path(act, gran, qgran, m, k, n, threads):
    """Dynamic per-token or per-tensor activation scales computed and applied inside the
    fused kernel: the bits of ``quantize_activation`` followed by the fused matmul with those
    scales, for an all-zero token (the scale floor), NaN, inf, a huge value (per tensor: it
    sets the scale, the rest falls to the subnormals and zero) and tiny ones, at 1 and 2
    threads."""
    w8 = _all_codes_weight(n, k, torch.float8_e4m3fn)
    ws = _weight_scale(n, k, gran)
    x = torch.randn(m, k) * torch.logspace(-6, 3, k)
    x[min(1, m - 1)] = 0.0
    x[5 % m, : min(7, k)] = 1e-30  # first: a single token keeps the values below
    x[2 % m, 1 % k], x[3 % m, 3 % k], x[4 % m, 0] = float("nan"), float("inf"), 1e30
    got, want = _two_step(x.to(torch.bfloat16), w8, ws, None, gran, act, qgran, threads)
    assert got.isnan().any(), "the NaN token should reach the output"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("act", sorted(FORMATS))
@pytest.mark.parametrize(("m", "k", "n"), DYNAMIC_SHAPES[:4])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_kernel_dynamic_tensor_scale_without_outliers(act, m, k, n, threads):
    """Per tensor, finite values spread over 9 decades (the fp8 normals, subnormals and
    values rounding to zero, the amax exactly at the format's max): the two-step bits, and
    within the float64 bound of the fake-quantized operands."""
    w8 = _all_codes_weight(n, k, torch.float8_e4m3fn)
    ws = _weight_scale(n, k, "row")
    x = (torch.randn(m, k) * torch.logspace(-6, 3, k)).to(torch.bfloat16)
    got, want = _two_step(x, w8, ws, None, "row", act, "tensor", threads)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    a64, _ = _activation(x, "dynamic_tensor", FORMATS[act])
    w64 = w8.double() * ws.double().reshape(-1, 1)
    ref = a64 @ w64.T
    assert bool(((got.double() - ref).abs() <= _bound(a64, w64, ref, 2**-7, 2**-7)).all())


@pytest.mark.parametrize("fill", [0.0, float("nan"), float("inf")])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_kernel_dynamic_tensor_scale_of_nothing_finite(fill, threads):
    """A tensor without a finite nonzero value: the amax is 0, the scale the floor, as in
    ``quantize_activation`` (zeros stay zeros, NaN / inf become NaN)."""
    w8 = _all_codes_weight(30, 64, torch.float8_e4m3fn)
    ws = _weight_scale(30, 64, "row")
    x = torch.full((40, 64), fill).to(torch.bfloat16)
    got, want = _two_step(x, w8, ws, None, "row", "e4m3", "tensor", threads)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert bool(got.isnan().all()) if fill != 0.0 else bool((got == 0).all())


@pytest.mark.parametrize("scheme", ["dynamic_token", "dynamic_tensor"])
def test_dynamic_linear_quantizes_inside_the_fused_kernel(fused, monkeypatch, scheme):
    """A bf16 dynamic (per-token or per-tensor) linear above the GEMV limit is one fused_mm
    call with in-kernel quantization (no separate quantize_activation pass), within the
    float64 bound of the fake-quantized operands."""
    monkeypatch.setattr(
        cpu_kernel, "quantize_activation", lambda *a, **k: pytest.fail("separate quantization")
    )
    w8 = _all_codes_weight(40, 96, torch.float8_e4m3fn)
    ws = _weight_scale(40, 96, "row")
    x = torch.randn(33, 96).to(torch.bfloat16)
    a64, kwargs = _activation(x, scheme, torch.float8_e4m3fn)
    out = _run(x, w8, ws, None, "row", kwargs, monkeypatch, True)
    assert len(fused) == 1 and out.shape == (33, 40)
    w64 = w8.double() * ws.double().reshape(-1, 1)
    ref = a64 @ w64.T
    assert bool(((out.double() - ref).abs() <= _bound(a64, w64, ref, 2**-7, 2**-7)).all())


@pytest.mark.parametrize("act", sorted(FORMATS))
@pytest.mark.parametrize("gran", ["row", "block"])
@pytest.mark.parametrize(("m", "k", "n"), [(300, 2050, 61), (250, 2050, 230), (17, 96, 40)])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_kernel_static_quantization_is_the_two_step_path(act, gran, m, k, n, threads):
    """A static (given, per-tensor) activation scale applied inside the fused kernel: the
    bits of ``quantize_activation`` with that scale followed by the fused matmul with it as
    the post scale, for NaN, inf, values that saturate and values below the fp8 subnormals,
    two token blocks or one, a partial last 16 tokens, at 1 and 2 threads."""
    w8 = _all_codes_weight(n, k, torch.float8_e4m3fn)
    ws = _weight_scale(n, k, gran)
    x = torch.randn(m, k) * torch.logspace(-6, 3, k)
    x[2, 3], x[3, 5], x[4, 0], x[5, :7] = float("nan"), float("inf"), 1e30, 1e-30
    x = x.to(torch.bfloat16)
    scale = torch.tensor([0.5 / torch.finfo(FORMATS[act]).max])  # |x| > 0.5 saturates
    got, want = _two_step(x, w8, ws, scale, gran, act, "tensor", threads)
    assert got.isnan().any(), "the NaN token should reach the output"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_static_linear_quantizes_inside_the_fused_kernel(fused, monkeypatch):
    """A bf16 static linear above the GEMV limit is one fused_mm call with in-kernel
    quantization (no separate quantize_activation pass), within the float64 bound."""
    monkeypatch.setattr(
        cpu_kernel, "quantize_activation", lambda *a, **k: pytest.fail("separate quantization")
    )
    w8 = _all_codes_weight(40, 96, torch.float8_e4m3fn)
    ws = _weight_scale(40, 96, "row")
    x = torch.randn(33, 96).to(torch.bfloat16)
    a64, kwargs = _activation(x, "static", torch.float8_e4m3fn)
    out = _run(x, w8, ws, None, "row", kwargs, monkeypatch, True)
    assert len(fused) == 1 and out.shape == (33, 40)
    w64 = w8.double() * ws.double().reshape(-1, 1)
    ref = a64 @ w64.T
    assert bool(((out.double() - ref).abs() <= _bound(a64, w64, ref, 2**-7, 2**-7)).all())


def test_fused_mm_refuses_two_static_scales(monkeypatch):
    """In-kernel quantization takes no scale (dynamic) or one (static), never per token."""
    w8 = _all_codes_weight(30, 64, torch.float8_e4m3fn)
    ws = _weight_scale(30, 64, "row")
    x = torch.randn(20, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"no scale \(dynamic\) or one \(static\)"):
        cpu_kernel.fused_mm(
            x, w8, ws, torch.ones(20), None, "row", *BLOCK, True, PATH,
            quantize=torch.float8_e4m3fn,
        )  # fmt: skip


def test_fused_mm_refuses_block_quantization():
    """In-kernel dynamic scales are per token or per tensor; per-block activations take the
    separate quantize_activation pass (the error names the accepted values)."""
    w8 = _all_codes_weight(30, 64, torch.float8_e4m3fn)
    ws = _weight_scale(30, 64, "row")
    x = torch.randn(20, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'row' \(per token\) or 'tensor'"):
        cpu_kernel.fused_mm(
            x, w8, ws, None, None, "row", *BLOCK, True, PATH,
            quantize=torch.float8_e4m3fn, quantize_gran="block",
        )  # fmt: skip
