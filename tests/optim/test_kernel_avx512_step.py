"""The C kernel's AVX-512 loops give the scalar loops' bits for whole steps, with and without
AVX-512 VBMI: the update loop's decode (a byte-table B index with VBMI, masked permutes
without), the requantization's 64-code packing (VBMI only), the per-thread cache of B tables
(both) and the casts. The kernel is built three times from its source: as the optimizer builds
it (-march=native), with ``-mno-avx512vbmi`` (AVX-512 machines before Ice Lake / Zen 4) and
with ``-mno-avx2`` (the scalar loops, which test_implementations and test_kernel_vector_paths
tie to the reference); all run the same steps on the same state (the states, gradients and
group sizes of test_kernel_avx2_step: zeros, subnormal and NaN gradients, more exponents k than
the cache's 64 slots)."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from hf_fp8.optim import _cpu_kernel
from hf_fp8.utils import native
from tests.optim.test_kernel_avx2_step import VARIANTS, State, gradient, hyperparams

BUILDS = {
    "avx512": ((), ("avx512dq", "avx512vbmi")),
    "avx512_no_vbmi": (("-mno-avx512vbmi",), ("avx512dq",)),
    "scalar": (("-mno-avx2",), ()),
}


def libs(variant: int) -> dict[str, ctypes.CDLL]:
    if platform.machine() not in ("x86_64", "AMD64") or native.compiler() is None:
        pytest.skip("x86-64 with a C compiler only")
    out = {}
    for name, (flags, features) in BUILDS.items():
        missing = [f for f in features if f not in native.cpu_features()]
        if missing:
            pytest.skip(f"no {', '.join(missing)} on this machine: the {name} loops are not built")
        lib = native.load_library(
            f"adamw_fp8_avx512_step_{name}_{variant}",
            _cpu_kernel.SOURCE,
            defines=_cpu_kernel.kernel_defines(variant),
            cflags=flags,
        )
        lib.adamw_fp8_step.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        lib.adamw_fp8_step.restype = ctypes.c_int
        out[name] = lib
    return out


@pytest.mark.parametrize("kind", ["realistic", "33-decades", "mixed"])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize(
    ("rows", "cols", "gs"),
    [(24, 1024, 128), (9, 512, 256), (12, 288, 96), (8, 200, 48), (6, 64, 8)],
    ids=["gs128", "gs256", "gs96", "gs48", "gs8"],
)
def test_avx512_step_is_the_scalar_step_bit_for_bit(rows, cols, gs, variant, kind):
    v = VARIANTS[variant]
    built = libs(v)
    start = State(rows, cols, gs, bool(v & _cpu_kernel.P_BF16), seed=gs)
    states = {name: start.copy() for name in built}
    for t in range(1, 5):
        hp = hyperparams(t)
        g = gradient(start, t, kind)
        for name, lib in built.items():
            states[name].step(lib, g, hp, v, t)
        s = states["scalar"].arrays()
        for name in ("avx512", "avx512_no_vbmi"):
            a = states[name].arrays()
            for key in a:
                differ = a[key].view(np.uint8) != s[key].view(np.uint8)
                assert not differ.any(), (
                    f"{name}, step {t}: {key} differs in {int(differ.sum())} bytes"
                )
    final = states["scalar"]
    assert (final.mk != 1).any()  # expanded groups
    if kind == "mixed" and gs == 128:  # more exponents of v than cache slots: it evicts
        assert np.unique(final.vk).size > 64
    assert (final.vq != 0).mean() > 0.5  # most codes non-zero
