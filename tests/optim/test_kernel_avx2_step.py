"""The C kernel's AVX2 loops (machines without AVX-512: Zen 1-3, Intel clients) give the scalar
loops' bits for whole steps, on any x86-64 machine with AVX2: the kernel is built twice from its
source, once with ``-mno-avx512f`` (the 8-lane loops: byte-plane decode, the update loop, the
requantization with 8, 4 or 1 vectors interleaved) and once with ``-mno-avx2`` (the scalar
loops, which test_implementations and test_kernel_vector_paths tie to the reference), and both
run the same steps on the same state. On an AVX-512 machine the optimizer itself never runs the
AVX2 loops: this is where they are checked there.

Group sizes: 128 (the default: 8 interleaved vectors), 256 (two such blocks), 96 and 32 (4
vectors), 48 and 8 (one vector; 48 decodes with vpermps, 8 codes at a time), 7 (scalar only).
Moments span a few decades per group (realistic), 33 decades (k at its minimum) and 0.001 to 3
decades varying along the rows (mixed: more exponents k than the 64 slots of the AVX2 loops'
cache of B tables, which then evicts), with zeros, subnormal gradients and a NaN gradient."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
import torch

from hf_fp8.optim import _cpu_kernel, _step
from hf_fp8.utils import native

BUILDS = {"avx2": ("-mno-avx512f",), "scalar": ("-mno-avx2",)}
VARIANTS = {
    "default": _cpu_kernel.EXPAND | _cpu_kernel.SR_V,
    "rtn": _cpu_kernel.EXPAND,
    "sr": _cpu_kernel.EXPAND | _cpu_kernel.SR_M | _cpu_kernel.SR_V,
    "bf16": _cpu_kernel.EXPAND | _cpu_kernel.SR_V | _cpu_kernel.P_BF16 | _cpu_kernel.G_BF16,
}


def libs(variant: int) -> dict[str, ctypes.CDLL]:
    if platform.machine() not in ("x86_64", "AMD64") or native.compiler() is None:
        pytest.skip("x86-64 with a C compiler only")
    if "avx2" not in native.cpu_features():
        pytest.skip("no AVX2 on this machine: the AVX2 loops are not built")
    out = {}
    for name, flags in BUILDS.items():
        lib = native.load_library(
            f"adamw_fp8_avx2_step_{name}_{variant}",
            _cpu_kernel.SOURCE,
            defines=_cpu_kernel.kernel_defines(variant),
            cflags=flags,
        )
        lib.adamw_fp8_step.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        lib.adamw_fp8_step.restype = ctypes.c_int
        out[name] = lib
    return out


class State:
    """A parameter of rows x cols, its gradient and both moments' codes, scales and exponents."""

    def __init__(self, rows: int, cols: int, gs: int, bf16: bool, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.rows, self.cols, self.gs = rows, cols, gs
        ng = rows * -(-cols // gs)
        p = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        self.bf16 = bf16
        self.p = self._store(p)
        self.mq = np.zeros(ng * gs, np.uint8)
        self.vq = np.zeros(ng * gs, np.uint8)
        self.ms, self.mk = np.zeros(ng, np.float32), np.ones(ng, np.float32)
        self.vs, self.vk = np.zeros(ng, np.float32), np.ones(ng, np.float32)

    def _store(self, x: np.ndarray) -> np.ndarray:
        if not self.bf16:
            return np.ascontiguousarray(x, np.float32)
        return torch.from_numpy(np.ascontiguousarray(x)).bfloat16().view(torch.int16).numpy()

    def copy(self) -> State:
        other = object.__new__(State)
        other.__dict__ = {
            k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in self.__dict__.items()
        }
        return other

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, np.ndarray)}

    def step(
        self,
        lib: ctypes.CDLL,
        g: np.ndarray,
        hp: np.ndarray,
        variant: int,
        t: int,
        threads: int = 1,
    ) -> None:
        n, ng = self.rows * self.cols, self.ms.size
        fields = {
            "p": self.p.ctypes.data,
            "g": g.ctypes.data,
            "m_q": self.mq.ctypes.data,
            "m_s": self.ms.ctypes.data,
            "m_k": self.mk.ctypes.data,
            "v_q": self.vq.ctypes.data,
            "v_s": self.vs.ctypes.data,
            "v_k": self.vk.ctypes.data,
            "hp": hp.ctypes.data,
            "rows": self.rows,
            "cols": self.cols,
            "group_size": self.gs,
            "flags": variant,
            "key_m": 0x1234567 + 7919 * t,
            "key_v": 0x89ABCDE + 104729 * t,
            "p_n": n,
            "g_n": n,
            "m_q_n": ng * self.gs,
            "m_s_n": ng,
            "m_k_n": ng,
            "v_q_n": ng * self.gs,
            "v_s_n": ng,
            "v_k_n": ng,
            "hp_n": len(_step.HP_FIELDS),
        }
        task = (ctypes.c_int64 * len(_cpu_kernel.TASK_FIELDS))(
            *[fields[name] for name in _cpu_kernel.TASK_FIELDS]
        )
        assert lib.adamw_fp8_step(1, ctypes.cast(task, ctypes.c_void_p), threads) == 0


def hyperparams(t: int) -> np.ndarray:
    lr, wd, b1, b2 = 1e-3, 0.01, 0.9, 0.999
    values = {
        "decay": 1 - lr * wd,
        "step_size": lr / (1 - b1**t),
        "one_minus_beta1": 1 - b1,
        "beta2": b2,
        "one_minus_beta2": 1 - b2,
        "eps": 1e-8,
        "inv_bc2": 1 / np.sqrt(1 - b2**t),
    }
    return np.array([values[name] for name in _step.HP_FIELDS], np.float32)


def gradient(state: State, t: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(1000 + t)
    shape = (state.rows, state.cols)
    if kind == "33-decades":  # in every group: k at its minimum
        g = 10.0 ** rng.uniform(-35, -2, shape) * rng.choice([-1, 1], shape)
    elif kind == "mixed":  # 0.001 to 3 decades, varying along each row: k takes > 64 values
        span = 10.0 ** rng.uniform(-3, 0.5, (shape[0], 1 + shape[1] // 8))
        span = np.repeat(span, 8, axis=1)[:, : shape[1]]
        g = 10.0 ** (-2 - span * rng.random(shape)) * rng.choice([-1, 1], shape)
    else:
        g = rng.standard_normal(shape) * 1e-3 * rng.random(shape)
    g = g.astype(np.float32)
    g.reshape(-1)[:: 11 + t] = 0.0
    g.reshape(-1)[5::97] = 1e-40  # subnormal: g² is 0
    if t == 2:
        g.reshape(-1)[3] = np.nan  # a NaN moment in one group
    return state._store(g)


@pytest.mark.parametrize("kind", ["realistic", "33-decades", "mixed"])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize(
    ("rows", "cols", "gs"),
    [
        (24, 1024, 128),
        (9, 512, 256),
        (12, 288, 96),
        (10, 96, 32),
        (8, 200, 48),
        (6, 64, 8),
        (5, 70, 7),
    ],
    ids=["gs128", "gs256", "gs96", "gs32", "gs48", "gs8", "gs7"],
)
def test_avx2_step_is_the_scalar_step_bit_for_bit(rows, cols, gs, variant, kind):
    v = VARIANTS[variant]
    built = libs(v)
    start = State(rows, cols, gs, bool(v & _cpu_kernel.P_BF16), seed=gs)
    states = {name: start.copy() for name in built}
    for t in range(1, 5):
        hp = hyperparams(t)
        g = gradient(start, t, kind)
        for name, lib in built.items():
            states[name].step(lib, g, hp, v, t)
        a, s = states["avx2"].arrays(), states["scalar"].arrays()
        for key in a:
            differ = a[key].view(np.uint8) != s[key].view(np.uint8)
            assert not differ.any(), f"step {t}: {key} differs in {int(differ.sum())} bytes"
    final = states["scalar"]
    assert (final.mk != 1).any()  # expanded groups
    if kind == "mixed" and gs == 128:  # more exponents of v than cache slots: it evicts
        assert np.unique(final.vk).size > 64
    assert (final.vq != 0).mean() > 0.5  # most codes non-zero


def test_avx2_step_on_three_threads_is_the_scalar_step():
    """1,280 groups: the kernel starts 3 threads (one per 256 groups at least), each with its
    own cache of B tables; the split changes no bit."""
    v = VARIANTS["default"]
    built = libs(v)
    start = State(160, 1024, 128, False, seed=9)
    states = {name: start.copy() for name in built}
    for t in range(1, 4):
        hp, g = hyperparams(t), gradient(start, t, "mixed")
        states["avx2"].step(built["avx2"], g, hp, v, t, threads=3)
        states["scalar"].step(built["scalar"], g, hp, v, t, threads=1)
        a, s = states["avx2"].arrays(), states["scalar"].arrays()
        for key in a:
            assert np.array_equal(a[key].view(np.uint8), s[key].view(np.uint8)), (t, key)
