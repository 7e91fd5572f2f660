"""The C kernel's AVX-512 loops (groups whose length is a multiple of 16; the fp8 COAT
requantization interleaves 8 vectors when the length is a multiple of 128, else one) and its
scalar loops (other lengths) give the reference's bits, for the default group size and
others: with ``group_size=32`` every group takes the one-vector loops; with 48 the rows of
256, 4096 and 200 columns end in groups of 16 (vector) and 8 (scalar) elements; 7 is all
scalar; 16, 96 and 256 are other multiples of 16 (256: two 128-element interleaved blocks).

Two kinds of gradients: the adversarial ones of ``test_implementations`` (33 decades per group:
COAT's exponent k sits at its minimum, where the decoded log-format offsets are integers) and
realistic ones (a few decades per group: k > 1/16, fractional offsets, every rounding path)."""

from __future__ import annotations

import pytest
import torch

from hf_fp8.optim import AdamWFp8, _cpu_kernel
from tests.optim.test_implementations import (
    HP,
    SHAPES,
    adversarial_grads,
    assert_bit_identical,
    needs_kernel,
)

CASES = [  # (param dtype, grad dtype, options)
    (torch.float32, torch.float32, {"moment_format": "log"}),  # SR of v
    (torch.bfloat16, torch.bfloat16, {"moment_format": "log", "stochastic_rounding": True}),
    (torch.float32, torch.bfloat16, {"moment_format": "log", "stochastic_rounding": False}),
    (torch.float32, torch.float32, {}),  # the default: fp8 COAT codes, SR of v
    (torch.bfloat16, torch.float32, {"stochastic_rounding": True}),
    (torch.float32, torch.float32, {"stochastic_rounding": False}),
]


def realistic_grads(params: list[torch.Tensor], step: int, grad_dtype: torch.dtype) -> None:
    """Gradients spanning about three decades per tensor, some exact zeros."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=g) * 1e-3 * torch.rand(p.shape, generator=g)
        grad.view(-1)[:: 11 + step] = 0.0
        if grad_dtype != p.dtype and hasattr(p, "grad_dtype"):
            p.grad_dtype = None
        p.grad = grad.to(grad_dtype)


def run(implementation, param_dtype, grad_dtype, grads, steps=3, **options):
    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(param_dtype)) for s in SHAPES
    ]
    opt = AdamWFp8(params, implementation=implementation, **HP, **options)
    for step in range(steps):
        grads(params, step, grad_dtype)
        opt.step()
    return params, opt


@needs_kernel
@pytest.mark.parametrize("grads", [adversarial_grads, realistic_grads], ids=lambda f: f.__name__)
@pytest.mark.parametrize("group_size", [128, 32, 48, 7, 16, 96, 256])
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype", "options"),
    CASES,
    ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else str(x),
)
def test_vector_and_scalar_group_loops_are_bit_identical_to_reference(
    param_dtype, grad_dtype, options, group_size, grads
):
    options = {**options, "group_size": group_size}
    reference = run("reference", param_dtype, grad_dtype, grads, **options)
    kernel = run("cpu_kernel", param_dtype, grad_dtype, grads, **options)
    assert_bit_identical(reference, kernel)


@needs_kernel
@pytest.mark.parametrize(
    "options",
    [{"moment_format": "log"}, {}, {"moment_format": "log", "stochastic_rounding": True}],
    ids=["log-sr_v", "fp8-sr_v", "log-sr"],
)
@pytest.mark.parametrize("group_size", [128, 48])
@pytest.mark.parametrize("openmp", [True, False], ids=["torch-openmp-pool", "posix-threads"])
def test_thread_split_does_not_change_results(options, openmp, group_size, monkeypatch):
    """Enough groups (1,266) for the kernel to run 1, 2 and 3 threads (it starts one per 256
    groups), which take their shares 64 groups at a time and then steal from the others':
    every split gives the reference's bits, on torch's OpenMP pool and on POSIX threads."""
    monkeypatch.setenv(_cpu_kernel.OPENMP_ENV, "1" if openmp else "0")
    monkeypatch.setattr(_cpu_kernel, "_LIBS", {})
    monkeypatch.setattr(_cpu_kernel, "_ERRORS", {})
    if openmp and not _cpu_kernel.shares_torch_openmp():
        pytest.skip("torch does not run on GCC's libgomp here")
    shapes = [(600, 256), (33, 200)]

    def steps(threads: int, implementation: str = "cpu_kernel"):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            g = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]
            opt = AdamWFp8(
                params, implementation=implementation, **HP, **options, group_size=group_size
            )
            for step in range(2):
                realistic_grads(params, step, torch.float32)
                opt.step()
        finally:
            torch.set_num_threads(saved)
        return params, opt

    reference = steps(1, "reference")
    assert sum(-(-s[1] // group_size) * s[0] for s in shapes) > 3 * 256
    for threads in (1, 2, 3):
        assert_bit_identical(reference, steps(threads))


@needs_kernel
def test_openmp_build_that_brings_its_own_runtime_is_not_used(monkeypatch):
    """A -fopenmp kernel that maps a second OpenMP runtime (not torch's) would spin threads of
    its own beside torch's: the kernel then runs on POSIX threads instead."""
    from hf_fp8.utils import native

    monkeypatch.setenv(_cpu_kernel.OPENMP_ENV, "1")
    monkeypatch.setattr(_cpu_kernel, "_LIBS", {})
    monkeypatch.setattr(_cpu_kernel, "_ERRORS", {})
    monkeypatch.setattr(_cpu_kernel, "_torch_libgomp_and_gcc", lambda: True)
    runtimes = iter([{"/torch/lib/libgomp.so.1"}, {"/torch/lib/libgomp.so.1", "/usr/libgomp.so.1"}])
    monkeypatch.setattr(_cpu_kernel, "_openmp_runtimes", lambda: next(runtimes))
    builds = []
    real = native.load_library

    def spy(*args, **kwargs):
        lib = real(*args, **kwargs)
        builds.append((tuple(kwargs.get("cflags", ())), lib))
        return lib

    monkeypatch.setattr(native, "load_library", spy)
    lib = _cpu_kernel.load(_cpu_kernel.variant(torch.float32, torch.float32, None, False, log=True))
    assert [flags for flags, _ in builds] == [("-fopenmp",), ()]
    assert lib is builds[1][1]
