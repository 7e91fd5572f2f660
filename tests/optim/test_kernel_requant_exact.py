"""The AVX-512 loops of the C kernel's COAT step give the scalar loops' values bit for bit,
before any rounding hides a difference: the fp32 magnitude each element is cast from (not
only its fp8 code) and the per-group decode tables.

The vector loops replace bit manipulations with single instructions (vgetexpps, vrangeps,
vfpclassps, vreduceps, vscalefps, masked min, conversions with embedded rounding). Such a
replacement can be wrong in 1 ulp where a code comparison rarely shows it: vreduceps rounds
an inexact ``y - floor(y)`` toward -inf where the scalar code (and torch) round to nearest,
which is exact in the requantization but not in the decode tables (``y = db/k``, any low
bits: a 1-ulp table entry changes a decoded moment, and a stochastically rounded code only
about once in 2^20 elements). Both
libraries here are built from the kernel source with a probe that records the magnitudes:
one as the default build (-march=native), one without AVX2 (the scalar loops, which the
other tests tie to the reference). The same for the AVX2 loops of machines without AVX-512
(8 lanes, built here with -mno-avx512f): their requantization computes the exponent, the
floor and the casts with AVX2 instructions instead, and their B tables come from a cache."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from hf_fp8.optim import _cpu_kernel
from hf_fp8.utils import native

GS = 128
PROBE = r"""
static float probe_mag[128];
#define REQUANT_PROBE_V(i, v) _mm512_storeu_ps(probe_mag + (i), (v))
#define REQUANT_PROBE_V8(i, v) _mm256_storeu_ps(probe_mag + (i), (v))
#define REQUANT_PROBE_S(i, m) (probe_mag[i] = (m))
"""
ENTRY = r"""
/* requantize ngroups groups of 128 as run_groups does (reductions, constants, requant) */
void probe_requant(const float* x, int64_t ngroups, uint32_t key, int sr, uint8_t* q, float* mag,
                   float* kk) {
    for (int64_t g = 0; g < ngroups; ++g) {
        const float* buf = x + g * 128;
        uint32_t amx = 0u, amn = INF_BITS;
        for (int i = 0; i < 128; ++i) {
            uint32_t a = f2b(buf[i]) & 0x7FFFFFFFu, af = a & not_nan(a);
            amx = af > amx ? af : amx;
            uint32_t an = (a >= FLT_MIN_BITS) ? a : INF_BITS;
            amn = an < amn ? an : amn;
        }
        float sc, ex, am, k, lm;
        quant_consts(&amx, &amn, &sc, &ex, &am, &k, &lm, 1, E4M3_MAX, E4M3_STEPS, 1);
        memset(probe_mag, 0, sizeof probe_mag);
        if (sr) requant(buf, q + g * 128, 128, 128, k, lm, am, b2f(amn), key + (uint32_t)(g * 128), 0, 1, 1, 0);
        else requant(buf, q + g * 128, 128, 128, k, lm, am, b2f(amn), key + (uint32_t)(g * 128), 0, 1, 0, 0);
        memcpy(mag + g * 128, probe_mag, sizeof probe_mag);
        kk[g] = k;
    }
}

/* the E4M3 decode tables (A: 16, B: 16 per group) of n groups */
void probe_tables(const float* scale, const float* expo, int64_t n, float* ta, float* tb) {
    float ea[32], db[16];
    decode_log2_tables(ea, db, 0);
    for (int64_t g0 = 0; g0 < n; g0 += CHUNK) {
        const int nb = (int)((n - g0) < CHUNK ? (n - g0) : CHUNK);
        float a[CHUNK][DEC_NA], b[CHUNK][DEC_NB];
        dequant_tables(scale + g0, expo + g0, a, b, ea, db, nb, E4M3_MAX, E4M3_LOG2MAX, 0, 0);
        for (int j = 0; j < nb; ++j) {
            memcpy(ta + (g0 + j) * 16, a[j], 16 * sizeof(float));
            memcpy(tb + (g0 + j) * 16, b[j], 16 * sizeof(float));
        }
    }
}

#if HAVE_AVX2_PATH
/* the B tables of n exponents, in order, from the AVX2 loops' cache (b_planes: byte planes,
   read back as floats) */
void probe_b_planes(const float* expo, int64_t n, float* tb) {
    float ea[32], db[16];
    decode_log2_tables(ea, db, 0);
    for (int64_t g = 0; g < n; ++g) {
        const planes16h_t* p = b_planes(b_cache, expo[g], db);
        uint8_t b[4][16];
        for (int k = 0; k < 4; ++k) _mm_storeu_si128((__m128i*)b[k], p->b[k]);
        for (int e = 0; e < 16; ++e) {
            uint32_t u = (uint32_t)b[0][e] | (uint32_t)b[1][e] << 8 | (uint32_t)b[2][e] << 16
                         | (uint32_t)b[3][e] << 24;
            memcpy(tb + g * 16 + e, &u, 4);
        }
    }
}
#endif

#if HAVE_DEC_AVX512
/* the AVX-512 loops' casts of magnitudes to codes (e4m3_code_rn_v, e4m3_code_sr_v) against the
   scalar ones (enc_fp8_mag, sr_code) on every bit pattern from 0 to F's (sr: with
   pseudo-random bits, a different draw per pattern); returns the number of codes that differ */
int64_t probe_code_mismatches(int sr) {
    enum { N = 4096 };
    static uint32_t bits[N] __attribute__((aligned(64))), rnd[N] __attribute__((aligned(64)));
    static uint8_t cv[N], cs[N];
    const uint32_t top = f2b(E4M3_MAX);
    int64_t bad = 0;
    for (uint64_t b0 = 0; b0 <= top; b0 += N) {
        for (uint32_t i = 0; i < N; ++i) {
            const uint32_t b = (uint32_t)(b0 + i <= top ? b0 + i : top);
            bits[i] = b;
            rnd[i] = (b * 0x9E3779B1u) ^ ((b >> 11) * 0x85EBCA6Bu);
        }
        for (int i = 0; i < N; i += 16) {
            __m512 mag = _mm512_castsi512_ps(_mm512_load_si512((const void*)(bits + i)));
            __m512i r = _mm512_load_si512((const void*)(rnd + i));
            __m512i c = sr ? e4m3_code_sr_v(mag, _mm512_srli_epi32(r, 32 - E4M3_SR_DROP))
                           : e4m3_code_rn_v(mag);
            _mm_storeu_si128((__m128i*)(cv + i), _mm512_cvtepi32_epi8(c));
        }
        for (int i = 0; i < N; ++i)
            cs[i] = sr ? sr_code(b2f(bits[i]), rnd[i], 0u, 0) : enc_fp8_mag(b2f(bits[i]), 0u, 0);
        for (int i = 0; i < N; ++i) bad += cv[i] != cs[i];
    }
    return bad;
}

/* the B tables of n exponents, in order, from the AVX-512 loops' cache (b_table16) */
void probe_b_tables16(const float* expo, int64_t n, float* tb) {
    float ea[32], db[16];
    decode_log2_tables(ea, db, 0);
    for (int64_t g = 0; g < n; ++g) memcpy(tb + g * 16, b_table16(b_cache16, expo[g], db), 64);
}
#endif
"""


# the vector loops under test: (name, CPU feature they need, flags that select them)
VECTOR_BUILDS = [("avx512", "avx512dq", ()), ("avx2", "avx2", ("-mno-avx512f",))]


@pytest.fixture(scope="module", params=VECTOR_BUILDS, ids=[b[0] for b in VECTOR_BUILDS])
def probes(request, tmp_path_factory):
    name, feature, cflags = request.param
    if platform.machine() != "x86_64" or native.compiler() is None:
        pytest.skip("x86-64 with a C compiler only")
    if feature not in native.cpu_features():
        pytest.skip(f"no {feature} on this machine: the {name} loops are not built")
    src = tmp_path_factory.mktemp("probe") / "requant_probe.c"
    src.write_text(PROBE + _cpu_kernel.SOURCE.read_text() + ENTRY)
    defines = _cpu_kernel.kernel_defines(_cpu_kernel.EXPAND | _cpu_kernel.SR_V)
    libs = {}
    for kind, flags in (("vector", cflags), ("scalar", ("-mno-avx2",))):
        lib = native.load_library(
            f"adamw_fp8_probe_{name}_{kind}", src, defines=defines, cflags=flags
        )
        lib.probe_requant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32]
        lib.probe_requant.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.probe_requant.argtypes += [ctypes.c_void_p]
        lib.probe_tables.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
        libs[kind] = lib
    return libs


def groups(n_groups: int, seed: int) -> np.ndarray:
    """Groups spanning 0.01 to 38 decades (k from its maximum to its minimum), random signs,
    some zeros, subnormals, infinities, NaNs and near-constant groups."""
    rng = np.random.default_rng(seed)
    decades = 10.0 ** rng.uniform(-2, np.log10(38), (n_groups, 1))
    top = rng.uniform(-30, 30, (n_groups, 1))
    x = 10.0 ** (top - decades * rng.random((n_groups, GS)))
    x = np.minimum(x, 3e38).astype(np.float32) * rng.choice([-1, 1], (n_groups, GS))
    special = rng.random((n_groups, GS))
    x[special < 0.01] = 0.0
    x[(special >= 0.01) & (special < 0.015)] = 1e-40  # subnormal
    x[(special >= 0.015) & (special < 0.017)] = np.inf
    x[(special >= 0.017) & (special < 0.019)] = np.nan
    x[::17] = x[::17, :1] * (1 + np.arange(GS, dtype=np.float32) * 1e-7)  # near-constant
    return np.ascontiguousarray(x, dtype=np.float32)


def requant(lib, x: np.ndarray, sr: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = x.shape[0]
    q = np.zeros(x.shape, np.uint8)
    mag = np.zeros(x.shape, np.float32)
    k = np.zeros(n, np.float32)
    lib.probe_requant(
        x.ctypes.data, n, 0x9E3779B9, int(sr), q.ctypes.data, mag.ctypes.data, k.ctypes.data
    )
    return q, mag, k


@pytest.mark.parametrize("sr", [False, True], ids=["rtn", "sr"])
def test_vector_requant_magnitudes_and_codes_are_the_scalar_ones(probes, sr):
    x = groups(8192, seed=int(sr))
    qv, mv, kv = requant(probes["vector"], x, sr)
    qs, ms, ks = requant(probes["scalar"], x, sr)
    assert np.array_equal(kv.view(np.uint32), ks.view(np.uint32))
    assert (kv < 1).any() and (kv > 4).any()  # expanded groups and near-constant ones
    differ = mv.view(np.uint32) != ms.view(np.uint32)
    assert not differ.any(), f"{differ.sum()} magnitudes differ, e.g. x={x[differ][:4]}"
    assert np.array_equal(qv, qs)
    assert (mv > 0).mean() > 0.9  # most elements reached the cast


@pytest.mark.parametrize("sr", [False, True], ids=["rtn", "sr"])
def test_vector_casts_are_the_scalar_ones_on_every_magnitude(probes, sr):
    """The AVX-512 loops' casts (the rounding constant folded with the exponent offset; the
    stochastic code without the clamp to F's code, a no-op) give the scalar casts' codes for
    every fp32 magnitude in [0, 448]: ties and near-ties of round-to-nearest-even included,
    which random groups reach about once in 2^19 elements."""
    if not hasattr(probes["vector"], "probe_code_mismatches"):
        pytest.skip("the AVX2 loops have no separate cast functions")
    probe = probes["vector"].probe_code_mismatches
    probe.restype = ctypes.c_int64
    probe.argtypes = [ctypes.c_int]
    assert probe(int(sr)) == 0


def test_vector_decode_tables_are_the_scalar_ones(probes):
    k = np.concatenate([np.arange(1, 16385, dtype=np.float32) / 16, [0.0625, 1024.0]])
    scale = np.float32(10.0) ** np.linspace(-44, 36, k.size, dtype=np.float32)
    rng = np.random.default_rng(2)
    k, scale = rng.permutation(k).astype(np.float32), scale.astype(np.float32)
    out = {}
    for name, lib in probes.items():
        ta = np.zeros((k.size, 16), np.float32)
        tb = np.zeros((k.size, 16), np.float32)
        lib.probe_tables(scale.ctypes.data, k.ctypes.data, k.size, ta.ctypes.data, tb.ctypes.data)
        out[name] = (ta, tb)
    for t_vec, t_sc in zip(out["vector"], out["scalar"], strict=True):
        assert np.array_equal(t_vec.view(np.uint32), t_sc.view(np.uint32))


def test_cached_b_tables_are_the_scalar_ones(probes):
    """The vector loops take each group's B table from a per-thread cache (64 slots tagged
    with k's bits): every k in turn (random order, so that slots are evicted and refilled)
    gives the scalar build's table (the AVX2 loops' byte planes with the zero code's entry 8
    set to 0)."""
    planes = hasattr(probes["vector"], "probe_b_planes")
    probe = probes["vector"].probe_b_planes if planes else probes["vector"].probe_b_tables16
    rng = np.random.default_rng(3)
    k = np.concatenate([np.arange(1, 16385, dtype=np.float32) / 16, [0.7, 3.3e-3, 2000.0]])
    k = np.concatenate([rng.permutation(k), rng.choice(k, 4096)]).astype(np.float32)
    scale = np.ones(k.size, np.float32)
    ta = np.zeros((k.size, 16), np.float32)
    tb = np.zeros((k.size, 16), np.float32)
    probes["scalar"].probe_tables(
        scale.ctypes.data, k.ctypes.data, k.size, ta.ctypes.data, tb.ctypes.data
    )
    if planes:
        tb[:, 8] = 0.0
    cached = np.zeros((k.size, 16), np.float32)
    probe.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    probe(k.ctypes.data, k.size, cached.ctypes.data)
    differ = (cached.view(np.uint32) != tb.view(np.uint32)).any(axis=1)
    assert not differ.any(), f"{differ.sum()} tables differ, e.g. k={k[differ][:4]}"
