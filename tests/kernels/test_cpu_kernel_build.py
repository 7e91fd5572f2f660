"""How the C CPU kernel library is built: the avx512bf16 path in two concurrent parts.

The split build (``FP8_PART`` 1 and 2, linked) and the whole build (one compile, used where
only one CPU is free) are the same code: every kernel gives the same bits from both.
"""

from __future__ import annotations

import pytest
import torch

from hf_fp8.kernels import cpu_kernel
from hf_fp8.utils import native


def test_avx512bf16_builds_in_two_parts_only_where_two_cpus_are_free(monkeypatch) -> None:
    calls = []

    def spy(name, source, **kwargs):
        calls.append((name, kwargs.get("parts", ())))
        raise native.NativeUnavailable("spy")

    monkeypatch.setattr(cpu_kernel, "load_library", spy)
    for cpus, want in ((2, ({"FP8_PART": 1}, {"FP8_PART": 2})), (1, ())):
        monkeypatch.setattr(cpu_kernel, "_cpus", lambda cpus=cpus: cpus)
        for path in ("avx512bf16", "avx512"):
            with pytest.raises(native.NativeUnavailable):
                cpu_kernel._build(path)
            assert calls[-1] == (f"fp8_gemv_{path}", want if path == "avx512bf16" else ())


def _run_all(path: str) -> list[torch.Tensor]:
    """One call of every exported kernel, on data with subnormal codes, NaN-free."""
    g = torch.Generator().manual_seed(0)
    n, k = 45, 320  # 45 rows: three full 14-row panels and a 3-row one
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x01
    w = codes.view(torch.float8_e4m3fn)
    ws = torch.rand(n, generator=g) + 0.5
    wsb = torch.rand(-(-n // 16), -(-k // 32), generator=g) + 0.5
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    outs = []
    for m in (1, 9, 40):
        a = torch.randn(m, k, generator=g).to(torch.bfloat16)
        outs.append(
            cpu_kernel._gemv_impl(
                a[: min(m, 16)].contiguous(), w, ws, None, None, "row", 16, 32, None,
                torch.bfloat16, path,
            )
        )  # fmt: skip
        outs.append(cpu_kernel.fused_mm(a, w, ws, None, bias, "row", 16, 32, True, path))
        outs.append(cpu_kernel.fused_mm(a, w, wsb, None, None, "block", 16, 32, False, path))
        outs.append(
            cpu_kernel.fused_mm(
                a, w, ws, None, None, "row", 16, 32, True, path, quantize=torch.float8_e4m3fn
            )
        )
        q, s = cpu_kernel.quantize_activation(
            a, None, torch.float8_e4m3fn, "row", 32, torch.bfloat16, True, path
        )
        outs += [q, s]
        outs.append(cpu_kernel._fp8_mm_impl(a, w, ws, s, bias, "row", 16, 32, True, path))
    outs.append(cpu_kernel.decode(w, wsb, "block", (16, 32), torch.bfloat16, path=path))
    return outs


@pytest.mark.skipif(
    "avx512bf16" not in cpu_kernel.supported_paths(), reason="the split build is avx512bf16's"
)
def test_split_and_whole_builds_give_the_same_bits(monkeypatch) -> None:
    split = cpu_kernel.library("avx512bf16")
    if split is None:
        pytest.skip(f"no avx512bf16 build here: {cpu_kernel.failure('avx512bf16')}")
    monkeypatch.setattr(cpu_kernel, "FUSED_MM", False)  # _fp8_mm_impl: decode + epilogue
    ref = _run_all("avx512bf16")
    monkeypatch.setattr(cpu_kernel, "_cpus", lambda: 1)
    monkeypatch.setattr(cpu_kernel, "_LIBS", {})
    monkeypatch.setattr(cpu_kernel, "_FAILED", {})
    whole = cpu_kernel.library("avx512bf16")
    assert whole is not None, cpu_kernel.failure("avx512bf16")
    assert whole._name != split._name  # another variant: one compile, no parts
    got = _run_all("avx512bf16")
    assert len(got) == len(ref)
    for i, (x, y) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"output {i} differs"
