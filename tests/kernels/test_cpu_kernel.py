"""The C CPU kernels (hf_fp8/kernels/csrc/fp8_gemv.c) on every code path this CPU runs.

References: a float64 product of the exactly decoded operands, the torch fp8 casts (decode,
bit for bit) and the emulation with the kernels off. Tolerances, elementwise:

* against float64: ``|out - ref| <= r1 |ref| + 2**-16 sum_k |a_k w_k|``; ``r1`` is one
  rounding of the output (2**-8 for bf16, 2**-10 fp16, 2**-22 fp32) and ``2**-16`` covers
  a reordered fp32 accumulation of up to a few hundred terms (K·2**-24 in the worst case);
  above 16 tokens the bf16 matmul also rounds the product to bf16 (``+ 2**-8 |a @ w.T|``)
  and block-scaled operands are folded into bf16 (``+ 2**-8 sum |terms|``), as in the
  emulation;
* against the emulation: that bound doubled, plus what the emulation itself rounds: its
  matmul path rounds the product to bf16 (``2**-8 |a @ w.T|``) and folds block scales into
  bf16 weights (``2**-8 sum |terms|``).
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel, cpu_linear, emulated
from hf_fp8.numerics import quantize

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# scheme -> (act numerics granularity or None for weight-only, static?)
SCHEMES = {
    "weight_only": (None, False),
    "dynamic_token": ("row", False),
    "dynamic_tensor": ("tensor", False),
    "dynamic_block": ("block", False),
    "static": ("tensor", True),
}
BLOCK = (16, 32)


def _paths() -> list[str]:
    paths = [p for p in cpu_kernel.supported_paths() if cpu_kernel.library(p) is not None]
    return paths or ["unavailable"]


PATHS = _paths()


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> str:
    if request.param == "unavailable":
        pytest.skip(f"no C kernel builds here: {cpu_kernel.failure('scalar')}")
    monkeypatch.setenv(cpu_kernel.ENV, request.param)
    return request.param


def _all_codes_weight(n: int, k: int, fmt: torch.dtype) -> torch.Tensor:
    """Random fp8 codes over the whole finite range, subnormals included."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    mag = codes & 0x7F
    bad = mag == 0x7F if fmt == torch.float8_e4m3fn else mag >= 0x7C
    codes[bad] = 0x01  # the smallest subnormal instead of NaN / inf
    codes[0, : min(k, 8)] = torch.arange(min(k, 8), dtype=torch.uint8)  # subnormals 0..7
    return codes.view(fmt)


def _weight_scale(n: int, k: int, gran: str) -> torch.Tensor:
    shape = {"tensor": (1,), "row": (n, 1), "block": (-(-n // BLOCK[0]), -(-k // BLOCK[1]))}
    return torch.rand(shape[gran]) * 1e-3 + 1e-4


def _expand64(scale: torch.Tensor, rows: int, cols: int, gran: str, block) -> torch.Tensor:
    s = scale.double()
    if gran == "block":
        s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return s.expand(rows, cols) if s.numel() == 1 or gran != "block" else s


def _activation(x: torch.Tensor, scheme: str, fmt: torch.dtype):
    """(exact float64 activation operand, kwargs for emulated_linear)."""
    gran, static = SCHEMES[scheme]
    if gran is None:
        return x.double(), {}
    m, k = x.shape
    if static:
        scale = torch.tensor([0.8 * float(x.float().abs().max()) / torch.finfo(fmt).max])
        q = (x.float() / scale).clamp(-torch.finfo(fmt).max, torch.finfo(fmt).max).to(fmt)
        kwargs = {"act_dtype": fmt, "act_granularity": "tensor", "input_scale": scale}
    else:
        q, scale = quantize(x, fmt, gran, (1, BLOCK[1]))
        kwargs = {"act_dtype": fmt, "act_granularity": gran}
    return q.double() * _expand64(scale, m, k, gran, (1, BLOCK[1])), kwargs


def _problem(fmt: str, gran: str, m: int, k: int, n: int):
    """(fp8 weight over every code, its scale, the exact float64 weight, bf16 bias, bf16 x)."""
    w8 = _all_codes_weight(n, k, FORMATS[fmt])
    ws = _weight_scale(n, k, gran)
    w64 = w8.double() * _expand64(ws, n, k, gran, BLOCK)
    return w8, ws, w64, torch.randn(n).to(torch.bfloat16), torch.randn(m, k).to(torch.bfloat16)


def _bound(a64, w64, out_ref, r1, r3):
    return r1 * out_ref.abs() + r3 * (a64.abs() @ w64.abs().T) + 1e-30


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 77, 37), (3, 300, 33), (4, 64, 40), (16, 131, 19), (40, 96, 70)]
)
def test_linear_matches_float64_and_the_emulation(path, monkeypatch, fmt, gran, m, k, n) -> None:
    dtype = FORMATS[fmt]
    w8, ws, w64, bias, x = _problem(fmt, gran, m, k, n)
    for scheme in SCHEMES:
        a64, kwargs = _activation(x, scheme, dtype)
        ref = a64 @ w64.T + bias.double()
        out = emulated.emulated_linear(x, w8, ws, bias, gran, BLOCK, **kwargs)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        err = (out.double() - ref).abs()
        blocky = "block" in (gran, SCHEMES[scheme][0])
        gemv = m <= cpu_linear.gemv_limit(path, torch.bfloat16, SCHEMES[scheme][0] == "block")
        if gemv:
            bound = _bound(a64, w64, ref, 2.0**-8, 2.0**-16)
        else:  # bf16 matmul: the product is rounded to bf16, block scales folded into bf16
            bound = _bound(a64, w64, ref, 2.0**-8, 2.0**-16 + (2.0**-8 if blocky else 0.0))
            bound = bound + 2.0**-8 * (a64 @ w64.T).abs()
        assert bool((err <= bound).all()), f"{scheme}: {float((err / bound).max()):.2f}x bound"
        monkeypatch.setenv(cpu_kernel.ENV, "off")
        emu = emulated.emulated_linear(x, w8, ws, bias, gran, BLOCK, **kwargs)
        monkeypatch.setenv(cpu_kernel.ENV, path)
        # the emulation folds block scales (weight or activation) into bf16 operands
        folded = 2.0**-8 if "block" in (gran, SCHEMES[scheme][0]) else 0.0
        bound = _bound(a64, w64, ref, 2.0**-7, 2.0**-15 + folded) + 2.0**-8 * (a64 @ w64.T).abs()
        diff = (out.double() - emu.double()).abs()
        assert bool((diff <= bound).all()), f"{scheme} vs emulation"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [2, 24])
def test_fp32_and_fp16_compute(path, dtype, m) -> None:
    w8 = _all_codes_weight(45, 100, torch.float8_e4m3fn)
    ws = _weight_scale(45, 100, "row")
    x = torch.randn(m, 100).to(dtype)
    out = emulated.emulated_linear(x, w8, ws, None, "row", BLOCK)
    ref = x.double() @ (w8.double() * ws.double()).T
    r1 = {torch.float32: 2.0**-22, torch.float16: 2.0**-10}[dtype]
    # fp16 above the GEMV limit is the emulation's: scales folded into fp16 operands
    r3 = 2.0**-9 if dtype == torch.float16 and m > cpu_linear.GEMV_MAX_TOKENS else 2.0**-16
    bound = _bound(x.double(), w8.double() * ws.double(), ref, r1, r3)
    assert out.dtype == dtype and bool(((out.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_is_bit_exact_for_every_code(path, fmt, dtype) -> None:
    """All 256 codes, NaN and inf included, unscaled and scaled, odd sizes (vector tails)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3)[: 7 * 103].reshape(7, 103)
    w8 = codes.contiguous().view(FORMATS[fmt])
    out = cpu_kernel.decode(w8, None, "row", BLOCK, dtype, path=path)
    torch.testing.assert_close(out, w8.float().to(dtype), rtol=0, atol=0, equal_nan=True)
    for gran in ("tensor", "row", "block"):
        ws = _weight_scale(7, 103, gran) * 7.3
        got = cpu_kernel.decode(w8, ws.reshape(-1), gran, BLOCK, dtype, path=path)
        want = (w8.float() * _expand64(ws, 7, 103, gran, BLOCK).float()).to(dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("scale", [7.3e-3, 1e-38, 1e37])
def test_scaled_bf16_decode_is_bit_identical_to_torch(path, fmt, scale) -> None:
    """Every code times a row scale, rounded to bf16, bit for bit as ``(w.float() * s).to(
    bf16)`` (NaN where it is NaN; torch's NaN payloads vary by code path), products below
    fp32's normal range (1e-38: subnormal, not flushed), above it (1e37: inf); rows of 320
    codes take the vector loops and a tail."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(5, 2)[:, 7 : 7 + 320]
    w8 = codes.contiguous().view(FORMATS[fmt])
    ws = torch.full((5, 1), scale) * torch.tensor([1.0, 1.5, 0.75, 1.25, 3.0]).reshape(5, 1)
    got = cpu_kernel.decode(w8, ws.reshape(-1), "row", BLOCK, torch.bfloat16, path=path)
    want = (w8.float() * ws).to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_nan_weight_code_gives_a_nan_row(path) -> None:
    w8 = _all_codes_weight(8, 64, torch.float8_e4m3fn)
    w8.view(torch.uint8)[5, 9] = 0x7F  # E4M3 NaN
    out = emulated.emulated_linear(
        torch.randn(2, 64).to(torch.bfloat16), w8, _weight_scale(8, 64, "row"), None, "row", BLOCK
    )
    assert bool(out[:, 5].isnan().all()) and bool(out[:, :5].isfinite().all())


def test_sizes_are_checked_before_the_c_call(path) -> None:
    w8 = _all_codes_weight(8, 64, torch.float8_e4m3fn)
    a = torch.randn(2, 64)
    with pytest.raises(ValueError, match="row weight scale must be 8"):
        cpu_kernel.cpu_gemv(a, w8, torch.ones(7), None, None, "row", 1, 1, None, a.dtype, path)
    with pytest.raises(ValueError, match="activation"):
        cpu_kernel.cpu_gemv(
            a[:, :63], w8, torch.ones(8), None, None, "row", 1, 1, None, a.dtype, path
        )
    with pytest.raises(ValueError, match="activation scale"):
        cpu_kernel.cpu_gemv(
            a, w8, torch.ones(8), torch.ones(3), None, "row", 1, 1, "token", a.dtype, path
        )
    with pytest.raises(ValueError, match="bias"):
        cpu_kernel.cpu_gemv(
            a, w8, torch.ones(8), None, torch.ones(9), "row", 1, 1, None, a.dtype, path
        )
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernel.decode(w8.t(), None, "row", BLOCK, torch.bfloat16, path=path)


def test_the_environment_forces_a_path_and_refuses_unknown_ones(monkeypatch) -> None:
    for path in PATHS:
        if path == "unavailable":
            pytest.skip("no C kernel here")
        monkeypatch.setenv(cpu_kernel.ENV, path)
        assert cpu_kernel.active_path() == path
    monkeypatch.setenv(cpu_kernel.ENV, "off")
    assert cpu_kernel.active_path() is None
    monkeypatch.setenv(cpu_kernel.ENV, "sse9")
    with pytest.raises(ValueError, match="auto, off, avx512bf16, avx512, avx2, neon, scalar"):
        cpu_kernel.active_path()
    foreign = "neon" if "neon" not in cpu_kernel.supported_paths() else "avx512"
    if foreign not in cpu_kernel.supported_paths():
        monkeypatch.setenv(cpu_kernel.ENV, foreign)
        with pytest.raises(ValueError, match="this CPU runs only"):
            cpu_kernel.active_path()


def test_auto_picks_the_widest_path_that_builds(monkeypatch) -> None:
    monkeypatch.setenv(cpu_kernel.ENV, "auto")
    monkeypatch.setattr(cpu_kernel, "_ACTIVE", {})
    assert cpu_kernel.active_path() == (PATHS[0] if PATHS[0] != "unavailable" else None)


def test_without_a_compiler_the_compiled_emulation_runs_with_one_warning(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernel, "_ACTIVE", {})
    monkeypatch.setattr(cpu_kernel, "_LIBS", {})
    monkeypatch.setattr(cpu_kernel, "_WARNED", set())
    monkeypatch.setattr(
        cpu_kernel, "_FAILED", {p: "NativeUnavailable: no C compiler" for p in cpu_kernel.PATHS}
    )
    monkeypatch.setenv(cpu_kernel.ENV, "auto")
    w8 = _all_codes_weight(8, 64, torch.float8_e4m3fn)
    ws = _weight_scale(8, 64, "row")
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        out = emulated.emulated_linear(x, w8, ws, None, "row", BLOCK)
    ref = x.double() @ (w8.double() * ws.double()).T
    assert bool(
        (
            (out.double() - ref).abs()
            <= _bound(x.double(), w8.double() * ws.double(), ref, 2.0**-7, 2.0**-15)
            + 2.0**-8 * ref.abs()
        ).all()
    )
    assert cpu_linear.linear(x, w8, ws, None, "row", BLOCK, None, None, None) is None


def test_custom_ops_compile_fullgraph_without_recompiles(path) -> None:
    """One graph for the token counts the GEMV takes, one more above (decode + matmul)."""
    w8 = _all_codes_weight(48, 64, torch.float8_e4m3fn)
    ws = _weight_scale(48, 64, "row")

    def fn(x):
        return emulated.emulated_linear(
            x, w8, ws, None, "row", BLOCK, act_dtype=torch.float8_e4m3fn, act_granularity="row"
        )

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
    limit = cpu_linear.gemv_limit(path, torch.bfloat16, act_block=False)
    for m in sorted({2, 3, limit // 2 + 1, limit - 1, limit}):
        x = torch.randn(m, 64).to(torch.bfloat16)
        torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1
    for m in (limit + 1, 30, 41, 64, 100):
        compiled(torch.randn(m, 64).to(torch.bfloat16))
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 16, 20])
def test_subnormal_codes_are_exact_not_flushed(path, fmt, m) -> None:
    """Every weight the smallest subnormal (E4M3 2**-9, E5M2 2**-16), scale 1, input 1:
    the output is exactly K times that value (a flush to zero would give 0)."""
    k = 192
    w8 = torch.full((24, k), 1, dtype=torch.uint8).view(FORMATS[fmt])
    tiny = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}[fmt]
    for dtype in (torch.bfloat16, torch.float32):
        out = emulated.emulated_linear(
            torch.ones(m, k, dtype=dtype), w8, torch.ones(24, 1), None, "row", BLOCK
        )
        assert bool((out == k * tiny).all()), (dtype, out.flatten()[:4])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("gran", ["tensor", "row", "block", "static"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_bit_identical_to_the_numerics(path, fmt, gran, x_dtype):
    """The C fake-quantization against the emulation's torch code: every value, scale and
    NaN equal; inputs span the subnormal fp8 range, exact ties, saturation and non-finite."""
    act = FORMATS[fmt]
    x = torch.randn(9, 133) * torch.logspace(-12, 3, 133)
    x[1, :40] = torch.arange(40) * 2.0**-10  # subnormal grid points and their midpoints
    x[2, 5], x[3, 7], x[4, 9], x[5, 0] = float("nan"), float("inf"), -float("inf"), 1e30
    x[6] = 0.0  # an all-zero token: the scale floor
    x = x.to(x_dtype)
    static = gran == "static"
    input_scale = torch.tensor([0.37]) if static else None
    ngran = "tensor" if static else gran
    for out_dtype in (torch.float32, torch.bfloat16):
        for post in (True, False) if ngran != "block" else (False,):
            got, got_s = cpu_kernel.quantize_activation(
                x, input_scale, act, ngran, 32, out_dtype, post, path
            )
            want, want_s = emulated._fake_quant_act(
                x, input_scale, act_dtype=act, gran=ngran, bk=32, out_dtype=out_dtype, post=post
            )
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            if post:
                torch.testing.assert_close(got_s, want_s.float(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_activation_quantization_rounds_every_bf16_value_as_the_numerics(path, fmt):
    """Every bf16 bit pattern (NaN, inf, subnormals included), and 65536 random fp32 ones,
    fake-quantized with static scales that give exact ties (powers of two), near-ties, values
    below the fp8 subnormals and saturation, and with dynamic per-token scales: bit for bit
    the emulation's torch code."""
    act = FORMATS[fmt]
    bits = torch.arange(-32768, 32768, dtype=torch.int32)
    xs = [
        bits.to(torch.int16).view(torch.bfloat16).reshape(256, 256),
        torch.randint(-(2**31), 2**31 - 1, (256, 256), dtype=torch.int32).view(torch.float32),
    ]
    scales = (2.0**-20, 2.0**-3, 1.0, 0.37, 3.0 / 7.0, 1e-30, 2.0**100)
    for x in xs:
        for scale in (*[torch.tensor([s]) for s in scales], None):
            gran = "row" if scale is None else "tensor"
            for out_dtype in (torch.float32, torch.bfloat16):
                got, _ = cpu_kernel.quantize_activation(
                    x, scale, act, gran, 1, out_dtype, True, path
                )
                want, _ = emulated._fake_quant_act(
                    x, scale, act_dtype=act, gran=gran, bk=1, out_dtype=out_dtype, post=True
                )
                nan = want.isnan()  # bits compared (signed zeros too), NaN by position
                assert torch.equal(got.isnan(), nan), (scale, out_dtype)
                ints = torch.int32 if out_dtype == torch.float32 else torch.int16
                assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan]), (scale, out_dtype)


@pytest.mark.parametrize("threads", ["openmp", "pthreads"])
def test_threads_split_rows_without_changing_a_bit(path, threads) -> None:
    """Rows over 2 threads (torch's OpenMP team, or POSIX threads when torch has none):
    every output bit equals the one-thread run (each row is one thread's sum)."""
    w8 = _all_codes_weight(515, 640, torch.float8_e4m3fn)
    ws = _weight_scale(515, 640, "row")
    lib = cpu_kernel.library(path)
    saved = torch.get_num_threads()
    try:
        if threads == "pthreads":
            lib.fp8_set_openmp(None)
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            for m in (1, 16, 40):
                x = torch.randn(m, 640, generator=torch.Generator().manual_seed(m))
                outs.append(
                    emulated.emulated_linear(x.to(torch.bfloat16), w8, ws, None, "row", BLOCK)
                )
                outs.append(
                    cpu_kernel.decode(w8, ws.reshape(-1), "row", BLOCK, torch.float32, path=path)
                )
        half = len(outs) // 2
        for one, two in zip(outs[:half], outs[half:], strict=True):
            assert torch.equal(one, two)
    finally:
        torch.set_num_threads(saved)
        lib.fp8_set_openmp(cpu_kernel._torch_openmp())
