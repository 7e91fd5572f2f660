"""The C kernel built for a baseline ISA (no AVX2 / AVX-512 on x86-64, plain ARMv8) gives the
reference's bits too: the kernel's numerics do not depend on the vector width the compiler
picked (the default build is -march=native, AVX-512 on this machine)."""

from __future__ import annotations

import platform

import pytest
import torch

from hf_fp8.utils import native
from tests.optim.kernel_builds import route_kernel_builds
from tests.optim.test_implementations import assert_bit_identical, run

BASELINE = {"x86_64": ("-march=x86-64", "-mtune=generic"), "aarch64": ("-march=armv8-a",)}
CASES = [  # (param dtype, fp8_format, expand, options)
    (torch.float32, "e4m3", True, {"moment_format": "log"}),  # SR of v
    (torch.bfloat16, "e4m3", True, {"stochastic_rounding": True, "moment_format": "log"}),
    (torch.float32, "e4m3", True, {}),  # the default: moment_format="fp8"
]


@pytest.fixture
def baseline_kernels(monkeypatch):
    """Route every kernel variant to a library built with the baseline ISA flags."""
    flags = BASELINE.get(platform.machine())
    if flags is None or native.compiler() is None:
        pytest.skip("no baseline ISA flags for this machine, or no C compiler")
    return route_kernel_builds(monkeypatch, "adamw_fp8_baseline", cflags=flags)


@pytest.mark.slow  # builds three libraries
@pytest.mark.parametrize(("dtype", "fp8_format", "expand", "options"), CASES)
def test_baseline_isa_kernel_is_bit_identical_to_reference(
    baseline_kernels, dtype, fp8_format, expand, options
):
    reference = run("reference", dtype, dtype, fp8_format, expand, **options)
    kernel = run("cpu_kernel", dtype, dtype, fp8_format, expand, **options)
    assert baseline_kernels  # the baseline libraries did the steps
    assert_bit_identical(reference, kernel)
