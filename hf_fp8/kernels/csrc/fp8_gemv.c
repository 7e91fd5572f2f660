/* FP8 linear on the CPU: a fused decode-and-reduce GEMV for few tokens, and a vectorized
 * fp8 -> bf16 / fp32 weight decode that feeds a bf16 matmul for many tokens.
 *
 * Built by hf_fp8.kernels.cpu_kernel with -DFP8_PATH=<n>:
 *   4 AVX-512 + VBMI + BF16: byte-table decode (vpermi2b) and bf16 dot products
 *   3 AVX-512 (F, BW, VL, DQ) + F16C + FMA    2 AVX2 + F16C + FMA    1 NEON (aarch64)
 *   0 plain C (portable; the compiler may auto-vectorize)
 *
 * Decoding is exact for every fp8 code, subnormals, NaN (and E5M2 inf) included. The
 * vector paths widen each code to fp16 bits and convert with the hardware fp16 -> fp32
 * instruction, which converts fp16 subnormals exactly and ignores DAZ:
 *   E5M2: fp16 bits = code << 8 (E5M2 is the top byte of fp16): the exact value;
 *   E4M3: fp16 bits = sign << 15 | (code & 0x7f) << 7: the exact value times 2^-8
 *         (E4M3 subnormals land on fp16 subnormals, still exact); 0x7f / 0xff -> NaN.
 * The 2^8 is applied once, to the fp32 accumulator (a power of two: exact). Products and
 * sums are fp32 FMAs.
 * Path 4 decodes with two 128-entry byte tables (the high and low byte of each code's exact
 * bf16 value) and, for bf16 activations, multiplies with vdpbf16ps: products of bf16 values
 * are exact in fp32 and summed in fp32. That instruction flushes subnormal *bf16* inputs and
 * fp32 partial sums to zero, but every fp8 value, subnormal codes included (E4M3 >= 2^-9,
 * E5M2 >= 2^-16), is a normal bf16 number, so every fp8 code stays exact; only activations
 * or partial sums below 2^-126 in magnitude (~1e-38) are lost.
 *
 * Numerics of the GEMV (the emulation's epilogue, in the same order):
 *   out[t, n] = (sum_k a[t,k] * w[n,k]) * (a_scale[t] * w_scale[n]) + bias[n]
 * with block weight scales applied to each K-block's partial sum instead. Sizes are
 * trusted: the Python wrapper checks every shape, dtype and contiguity before the call.
 * The sums multiply *unscaled* codes (up to 448, or 1.75 for E4M3 times 2^8 after), so
 * activations near FLT_MAX / 448 overflow them where the dequantized product is finite:
 * fp8_gemv, fp8_epilogue and fp8_mm_bf16 return 1 (not 0) when some output is +-inf or
 * NaN, and the Python wrapper recomputes that call with the scales folded into the operands
 * (R24 F1 / F2). The check costs one compare per output.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef FP8_PATH
#define FP8_PATH 0
#endif
/* FP8_PART: 0 (default) the whole library in one compile; 1 fp8_mm_bf16 and fp8_decode (the
 * fused GEMM and what shares its decode); 2 everything else. The avx512bf16 path builds parts
 * 1 and 2 by two concurrent compiler processes and links them (hf_fp8.utils.native's
 * `parts`): about 60 % of the wall time of one compile. A part compiles only the exported
 * functions it owns; static helpers it does not call are dropped before optimization. Shared
 * state: the OpenMP entry point (one hidden global); the decode tables are built per part. */
#ifndef FP8_PART
#define FP8_PART 0
#endif
#define IN_PART(p) (FP8_PART == 0 || FP8_PART == (p))
#if FP8_PATH >= 2
#include <immintrin.h>
#elif FP8_PATH == 1
#include <arm_neon.h>
#endif

#define AI static inline __attribute__((always_inline))
/* The non-fused matmul's epilogue (an elementwise pass, off this CPU's fused path) without
 * loop unswitching: at -O3 GCC copies its loop once per combination of scales and bias, 12 KB
 * of code and ~0.2 s of the build. (The GEMV's per-row epilogue keeps -O3: without the
 * copies it ran 1.5 % slower at 16 tokens, K = 2048.) The attribute only adds that flag:
 * -O3, -ffp-contract=off and the math flags of the command line still apply (same bits). */
#define NO_UNSWITCH __attribute__((optimize("no-unswitch-loops")))
#define MAX_THREADS 64

enum { FMT_E4M3 = 0, FMT_E5M2 = 1 };
enum { GRAN_TENSOR = 0, GRAN_ROW = 1, GRAN_BLOCK = 2 };
enum { ASCALE_NONE = 0, ASCALE_TENSOR = 1, ASCALE_TOKEN = 2 };
enum { OUT_F32 = 0, OUT_BF16 = 1 };

/* ---------------------------------------------------------------- scalar decode table */
/* LUT[fmt][code]: the value times 2^-8 for E4M3, the value for E5M2 (as the vector paths). */
static float LUT[2][256];
static pthread_once_t LUT_ONCE = PTHREAD_ONCE_INIT;
#if FP8_PATH == 4
static void tables_init(void);
#endif

static void lut_init(void) {
    for (int c = 0; c < 256; ++c) {
        float sign = (c & 0x80) ? -1.0f : 1.0f;
        int e4 = (c >> 3) & 15, m4 = c & 7;
        float v4 = (c & 0x7f) == 0x7f ? NAN
                   : e4 == 0          ? ldexpf((float)m4, -9)
                                      : ldexpf(1.0f + m4 / 8.0f, e4 - 7);
        LUT[FMT_E4M3][c] = sign * ldexpf(v4, -8);
        int e5 = (c >> 2) & 31, m5 = c & 3;
        float v5 = e5 == 31 ? (m5 ? NAN : INFINITY)
                   : e5 == 0 ? ldexpf((float)m5, -16)
                             : ldexpf(1.0f + m5 / 4.0f, e5 - 15);
        LUT[FMT_E5M2][c] = sign * v5;
    }
#if FP8_PATH == 4
    tables_init();
#endif
}

static float dec_factor(int fmt) { return fmt == FMT_E4M3 ? 256.0f : 1.0f; }

AI float bf16_bits_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

AI uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---------------------------------------------------------------- vector primitives */
#if FP8_PATH == 3 || FP8_PATH == 4
typedef __m512 vf;
#define VL 16 /* floats per vector; one decode step yields 2 vectors */
AI vf vzero(void) { return _mm512_setzero_ps(); }
AI vf vload(const float *p) { return _mm512_loadu_ps(p); }
AI vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
AI vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
AI vf vset(float x) { return _mm512_set1_ps(x); }
AI vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
AI float vsum(vf a) { return _mm512_reduce_add_ps(a); }
AI void vdec(const uint8_t *p, int fmt, vf *lo, vf *hi) {
    __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    if (fmt == FMT_E4M3) {
        __m512i mag = _mm512_and_si512(h, _mm512_set1_epi16(0x7f));
        __m512i sgn = _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi16(0x80)), 8);
        __mmask32 nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f));
        h = _mm512_or_si512(_mm512_slli_epi16(mag, 7), sgn);
        h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7e00));
    } else {
        h = _mm512_slli_epi16(h, 8);
    }
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
AI void vstore_bf16(uint16_t *p, vf v) { /* round to nearest even; NaN -> 0x7fc0 */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
AI void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
#elif FP8_PATH == 2
typedef __m256 vf;
#define VL 8
AI vf vzero(void) { return _mm256_setzero_ps(); }
AI vf vload(const float *p) { return _mm256_loadu_ps(p); }
AI vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
AI vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
AI vf vset(float x) { return _mm256_set1_ps(x); }
AI vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
AI float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
AI void vdec(const uint8_t *p, int fmt, vf *lo, vf *hi) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    if (fmt == FMT_E4M3) {
        __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x7f));
        __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
        __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
        h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), sgn);
        h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7e00), nan);
    } else {
        h = _mm256_slli_epi16(h, 8);
    }
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
AI void vstore_bf16(uint16_t *p, vf v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
AI void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
#elif FP8_PATH == 1
typedef float32x4_t vf;
#define VL 4
AI vf vzero(void) { return vdupq_n_f32(0.0f); }
AI vf vload(const float *p) { return vld1q_f32(p); }
AI vf vfma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
AI vf vadd(vf a, vf b) { return vaddq_f32(a, b); }
AI vf vset(float x) { return vdupq_n_f32(x); }
AI vf vmul(vf a, vf b) { return vmulq_f32(a, b); }
AI float vsum(vf a) { return vaddvq_f32(a); }
AI void vdec(const uint8_t *p, int fmt, vf *lo, vf *hi) {
    uint16x8_t h = vmovl_u8(vld1_u8(p));
    if (fmt == FMT_E4M3) {
        uint16x8_t mag = vandq_u16(h, vdupq_n_u16(0x7f));
        uint16x8_t sgn = vshlq_n_u16(vandq_u16(h, vdupq_n_u16(0x80)), 8);
        uint16x8_t nan = vceqq_u16(mag, vdupq_n_u16(0x7f));
        h = vorrq_u16(vshlq_n_u16(mag, 7), sgn);
        h = vbslq_u16(nan, vdupq_n_u16(0x7e00), h);
    } else {
        h = vshlq_n_u16(h, 8);
    }
    float16x8_t f = vreinterpretq_f16_u16(h);
    *lo = vcvt_f32_f16(vget_low_f16(f));
    *hi = vcvt_high_f32_f16(f);
}
AI void vstore_bf16(uint16_t *p, vf v) {
    float tmp[VL];
    vst1q_f32(tmp, v);
    for (int i = 0; i < VL; ++i) p[i] = f32_to_bf16(tmp[i]);
}
AI void vstore(float *p, vf v) { vst1q_f32(p, v); }
#endif

/* ---------------------------------------------------------------- GEMV */
typedef struct {
    const float *a;      /* [M, K] fp32 activation (fake-quantized already) */
    const uint8_t *w;    /* [N, K] fp8 codes */
    const float *ws;     /* weight scale: [1], [N] or [ceil(N/bn), ceil(K/bk)] */
    const float *as;     /* activation scale: NULL, [1] or [M] */
    const float *bias;   /* [N] fp32 or NULL */
    void *out;           /* [M, N] fp32 or bf16 */
    int64_t M, K, N, bn, bk, n0, n1;
    int fmt, wgran, agran, out_kind, a_bf16; /* a_bf16: a is [M, K] bf16 (path 4) */
    int *nonfinite;      /* set (shared by the threads) when an output is not finite */
} gemv_t;

/* Dot products of MT tokens with one weight row; block scales per K-segment (bs != NULL). */
#if FP8_PATH != 0
#define NACC(MT) ((MT) <= 2 ? 4 : 2)
#define DEFINE_TILE(MT)                                                                  \
    static void tile_##MT(const float *a, int64_t K, const uint8_t *w, int64_t seg,      \
                          const float *bs, int fmt, float *res) {                        \
        const float *lut = LUT[fmt];                                                     \
        float tot[MT];                                                                   \
        for (int t = 0; t < MT; ++t) tot[t] = 0.0f;                                      \
        for (int64_t k0 = 0, b = 0; k0 < K; k0 += seg, ++b) {                            \
            int64_t k1 = k0 + seg < K ? k0 + seg : K, k = k0;                            \
            vf acc[MT][NACC(MT)];                                                        \
            for (int t = 0; t < MT; ++t)                                                 \
                for (int j = 0; j < NACC(MT); ++j) acc[t][j] = vzero();                  \
            if (NACC(MT) == 4) {                                                         \
                for (; k + 4 * VL <= k1; k += 4 * VL) {                                  \
                    vf w0, w1, w2, w3;                                                   \
                    vdec(w + k, fmt, &w0, &w1);                                          \
                    vdec(w + k + 2 * VL, fmt, &w2, &w3);                                 \
                    for (int t = 0; t < MT; ++t) {                                       \
                        const float *at = a + t * K + k;                                 \
                        acc[t][0] = vfma(vload(at), w0, acc[t][0]);                      \
                        acc[t][1] = vfma(vload(at + VL), w1, acc[t][1]);                 \
                        acc[t][NACC(MT) - 2] = vfma(vload(at + 2 * VL), w2, acc[t][NACC(MT) - 2]); \
                        acc[t][NACC(MT) - 1] = vfma(vload(at + 3 * VL), w3, acc[t][NACC(MT) - 1]); \
                    }                                                                    \
                }                                                                        \
            }                                                                            \
            for (; k + 2 * VL <= k1; k += 2 * VL) {                                      \
                vf w0, w1;                                                               \
                vdec(w + k, fmt, &w0, &w1);                                              \
                for (int t = 0; t < MT; ++t) {                                           \
                    const float *at = a + t * K + k;                                     \
                    acc[t][0] = vfma(vload(at), w0, acc[t][0]);                          \
                    acc[t][1] = vfma(vload(at + VL), w1, acc[t][1]);                     \
                }                                                                        \
            }                                                                            \
            for (int t = 0; t < MT; ++t) {                                               \
                vf s = vadd(acc[t][0], acc[t][1]);                                       \
                if (NACC(MT) == 4) s = vadd(s, vadd(acc[t][NACC(MT) - 2], acc[t][NACC(MT) - 1])); \
                float part = vsum(s);                                                    \
                for (int64_t kk = k; kk < k1; ++kk) part += a[t * K + kk] * lut[w[kk]];  \
                tot[t] = bs ? fmaf(part, bs[b], tot[t]) : part;                          \
            }                                                                            \
        }                                                                                \
        for (int t = 0; t < MT; ++t) res[t] = tot[t];                                    \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(4)
#if FP8_PATH >= 3
DEFINE_TILE(8)
#define MAX_TILE 8
#else
#define MAX_TILE 4
#endif

static void row_dots(const gemv_t *g, const uint8_t *wrow, int64_t seg, const float *bs,
                     float *res) {
    int64_t t = 0;
    while (t < g->M) {
        int64_t left = g->M - t;
        const float *a = g->a + t * g->K;
#if MAX_TILE == 8
        if (left >= 8) { tile_8(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 8; continue; }
#endif
        if (left >= 4) { tile_4(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 4; }
        else if (left >= 2) { tile_2(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 2; }
        else { tile_1(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 1; }
    }
}
#else
static void row_dots(const gemv_t *g, const uint8_t *wrow, int64_t seg, const float *bs,
                     float *res) {
    const float *lut = LUT[g->fmt];
    for (int64_t t = 0; t < g->M; ++t) {
        const float *a = g->a + t * g->K;
        float tot = 0.0f;
        for (int64_t k0 = 0, b = 0; k0 < g->K; k0 += seg, ++b) {
            int64_t k1 = k0 + seg < g->K ? k0 + seg : g->K;
            float part = 0.0f;
            for (int64_t k = k0; k < k1; ++k) part += a[k] * lut[wrow[k]];
            tot = bs ? fmaf(part, bs[b], tot) : part;
        }
        res[t] = tot;
    }
}
#endif

#if FP8_PATH == 4
/* Byte tables: the high / low byte of the exact bf16 value of each magnitude code 0..127. */
static __m512i T_HI[2][2], T_LO[2][2], PERM;

static void tables_init(void) {
    uint8_t hi[128], lo[128], perm[64];
    for (int fmt = 0; fmt < 2; ++fmt) {
        for (int c = 0; c < 128; ++c) {
            float v = LUT[fmt][c] * dec_factor(fmt);
            uint32_t u;
            memcpy(&u, &v, 4);
            hi[c] = (uint8_t)(u >> 24);
            lo[c] = (uint8_t)(u >> 16);
        }
        T_HI[fmt][0] = _mm512_loadu_si512(hi);
        T_HI[fmt][1] = _mm512_loadu_si512(hi + 64);
        T_LO[fmt][0] = _mm512_loadu_si512(lo);
        T_LO[fmt][1] = _mm512_loadu_si512(lo + 64);
    }
    /* so that the per-128-bit-lane byte unpacks below give elements in order */
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 16; ++i) perm[16 * j + i] = (uint8_t)(i < 8 ? 8 * j + i : 32 + 8 * j + i - 8);
    PERM = _mm512_loadu_si512(perm);
}

/* 64 codes -> 64 exact bf16 values, in order: elements 0..31 in *o0, 32..63 in *o1. */
AI void dec64_bf16_v(__m512i codes, __m512i hi0, __m512i hi1, __m512i lo0, __m512i lo1,
                     __m512i perm, __m512i *o0, __m512i *o1) {
    __m512i c = _mm512_permutexvar_epi8(perm, codes);
    __m512i hi = _mm512_permutex2var_epi8(hi0, c, hi1); /* index bit 6 picks the table half */
    __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
    hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0xF8); /* | sign */
    *o0 = _mm512_unpacklo_epi8(lo, hi);
    *o1 = _mm512_unpackhi_epi8(lo, hi);
}

AI void dec64_bf16(const uint8_t *p, __m512i hi0, __m512i hi1, __m512i lo0, __m512i lo1,
                   __m512i perm, __m512i *o0, __m512i *o1) {
    dec64_bf16_v(_mm512_loadu_si512(p), hi0, hi1, lo0, lo1, perm, o0, o1);
}

AI float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* MT tokens of bf16 activations against one row: exact bf16 products summed in fp32. */
#define DEFINE_BTILE(MT)                                                                 \
    static void btile_##MT(const uint16_t *a, int64_t K, const uint8_t *w, int64_t seg,  \
                           const float *bs, int fmt, float *res) {                       \
        const float *lut = LUT[fmt];                                                     \
        const float factor = dec_factor(fmt);                                            \
        const __m512i hi0 = T_HI[fmt][0], hi1 = T_HI[fmt][1];                            \
        const __m512i lo0 = T_LO[fmt][0], lo1 = T_LO[fmt][1], perm = PERM;               \
        float tot[MT];                                                                   \
        for (int t = 0; t < MT; ++t) tot[t] = 0.0f;                                      \
        for (int64_t k0 = 0, b = 0; k0 < K; k0 += seg, ++b) {                            \
            int64_t k1 = k0 + seg < K ? k0 + seg : K, k = k0;                            \
            __m512 acc[MT][2];                                                           \
            for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();    \
            for (; k + 64 <= k1; k += 64) {                                              \
                __m512i w0, w1;                                                          \
                dec64_bf16(w + k, hi0, hi1, lo0, lo1, perm, &w0, &w1);                   \
                for (int t = 0; t < MT; ++t) {                                           \
                    const uint16_t *at = a + t * K + k;                                  \
                    acc[t][0] = _mm512_dpbf16_ps(acc[t][0],                              \
                        (__m512bh)_mm512_loadu_si512(at), (__m512bh)w0);                 \
                    acc[t][1] = _mm512_dpbf16_ps(acc[t][1],                              \
                        (__m512bh)_mm512_loadu_si512(at + 32), (__m512bh)w1);            \
                }                                                                        \
            }                                                                            \
            for (int t = 0; t < MT; ++t) {                                               \
                float part = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));  \
                for (int64_t kk = k; kk < k1; ++kk)                                      \
                    part += bf16_to_f32(a[t * K + kk]) * (lut[w[kk]] * factor);          \
                tot[t] = bs ? fmaf(part, bs[b], tot[t]) : part;                          \
            }                                                                            \
        }                                                                                \
        for (int t = 0; t < MT; ++t) res[t] = tot[t];                                    \
    }
DEFINE_BTILE(1)
DEFINE_BTILE(2)
DEFINE_BTILE(4)
DEFINE_BTILE(8)

/* Two weight rows x MT tokens: each activation load feeds both rows (half the L1 traffic). */
#define DEFINE_BTILE2(MT)\
static void btile2_##MT(const uint16_t *a, int64_t K, const uint8_t *w0r, const uint8_t *w1r,  \
                     int64_t seg, const float *bs0, const float *bs1, int fmt, float *res0,    \
                     float *res1) {                                                            \
    const float *lut = LUT[fmt];                                                               \
    const float factor = dec_factor(fmt);                                                      \
    const __m512i hi0 = T_HI[fmt][0], hi1 = T_HI[fmt][1];                                      \
    const __m512i lo0 = T_LO[fmt][0], lo1 = T_LO[fmt][1], perm = PERM;                         \
    float tot0[MT], tot1[MT];                                                                  \
    for (int t = 0; t < MT; ++t) tot0[t] = tot1[t] = 0.0f;                                     \
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += seg, ++b) {                                      \
        int64_t k1 = k0 + seg < K ? k0 + seg : K, k = k0;                                      \
        __m512 acc0[MT], acc1[MT];                                                             \
        for (int t = 0; t < MT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();                  \
        for (; k + 64 <= k1; k += 64) {                                                        \
            __m512i u0, u1, v0, v1;                                                            \
            dec64_bf16(w0r + k, hi0, hi1, lo0, lo1, perm, &u0, &u1);                           \
            dec64_bf16(w1r + k, hi0, hi1, lo0, lo1, perm, &v0, &v1);                           \
            for (int t = 0; t < MT; ++t) {                                                     \
                __m512bh x0 = (__m512bh)_mm512_loadu_si512(a + t * K + k);                     \
                __m512bh x1 = (__m512bh)_mm512_loadu_si512(a + t * K + k + 32);                \
                acc0[t] = _mm512_dpbf16_ps(acc0[t], x0, (__m512bh)u0);                         \
                acc1[t] = _mm512_dpbf16_ps(acc1[t], x0, (__m512bh)v0);                         \
                acc0[t] = _mm512_dpbf16_ps(acc0[t], x1, (__m512bh)u1);                         \
                acc1[t] = _mm512_dpbf16_ps(acc1[t], x1, (__m512bh)v1);                         \
            }                                                                                  \
        }                                                                                      \
        for (int t = 0; t < MT; ++t) {                                                         \
            float p0 = _mm512_reduce_add_ps(acc0[t]), p1 = _mm512_reduce_add_ps(acc1[t]);      \
            for (int64_t kk = k; kk < k1; ++kk) {                                              \
                float x = bf16_to_f32(a[t * K + kk]);                                          \
                p0 += x * (lut[w0r[kk]] * factor);                                             \
                p1 += x * (lut[w1r[kk]] * factor);                                             \
            }                                                                                  \
            tot0[t] = bs0 ? fmaf(p0, bs0[b], tot0[t]) : p0;                                    \
            tot1[t] = bs1 ? fmaf(p1, bs1[b], tot1[t]) : p1;                                    \
        }                                                                                      \
    }                                                                                          \
    for (int t = 0; t < MT; ++t) res0[t] = tot0[t], res1[t] = tot1[t];                         \
}
DEFINE_BTILE2(8)
DEFINE_BTILE2(4)

static void row_dots_bf16(const gemv_t *g, const uint8_t *wrow, int64_t seg, const float *bs,
                          float *res) {
    int64_t t = 0;
    while (t < g->M) {
        int64_t left = g->M - t;
        const uint16_t *a = (const uint16_t *)g->a + t * g->K;
        if (left >= 8) { btile_8(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 8; }
        else if (left >= 4) { btile_4(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 4; }
        else if (left >= 2) { btile_2(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 2; }
        else { btile_1(a, g->K, wrow, seg, bs, g->fmt, res + t); t += 1; }
    }
}
#endif

static void gemv_epilogue(const gemv_t *g, int64_t n, const float *res, float factor) {
    int block = g->wgran == GRAN_BLOCK, bad = 0;
    float wsc = g->wgran == GRAN_TENSOR ? g->ws[0] : g->wgran == GRAN_ROW ? g->ws[n] : 1.0f;
    for (int64_t t = 0; t < g->M; ++t) {
        float v = res[t] * factor;
        /* the two scales multiply first: acc * a_scale alone can overflow fp32 where the
           output is finite (activations near 1e38) */
        float sc = block ? 1.0f : wsc;
        if (g->agran == ASCALE_TENSOR) sc = g->as[0] * sc;
        else if (g->agran == ASCALE_TOKEN) sc = g->as[t] * sc;
        if (!block || g->agran == ASCALE_TENSOR || g->agran == ASCALE_TOKEN) v = v * sc;
        if (g->bias) v = v + g->bias[n];
        bad |= !isfinite(v);
        if (g->out_kind == OUT_BF16) ((uint16_t *)g->out)[t * g->N + n] = f32_to_bf16(v);
        else ((float *)g->out)[t * g->N + n] = v;
    }
    if (bad) __atomic_store_n(g->nonfinite, 1, __ATOMIC_RELAXED);
}

#if FP8_PATH == 4
#define CHUNK_MAX 64
/* Rows [n0, n1) (n1 - n0 <= CHUNK_MAX) for every token, token tile by token tile: a tile's
 * activations stay in L1 and the chunk's weights in L2 while every tile passes over them. */
static void gemv_chunk_bf16(const gemv_t *g, int64_t n0, int64_t n1, float res[][16]) {
    const uint16_t *a = (const uint16_t *)g->a;
    int64_t kblocks = (g->K + g->bk - 1) / g->bk;
    int block = g->wgran == GRAN_BLOCK;
    int64_t seg = block ? g->bk : g->K;
    for (int64_t t = 0; t < g->M;) {
        int64_t left = g->M - t, mt = left >= 8 ? 8 : left >= 4 ? 4 : left;
        const uint16_t *at = a + t * g->K;
        for (int64_t n = n0; n < n1; n += 2) {
            const float *bs0 = block ? g->ws + (n / g->bn) * kblocks : NULL;
            const uint8_t *w0 = g->w + n * g->K;
            if (n + 1 < n1 && mt >= 4) {
                const float *bs1 = block ? g->ws + ((n + 1) / g->bn) * kblocks : NULL;
                const uint8_t *w1 = w0 + g->K;
                if (mt == 8) btile2_8(at, g->K, w0, w1, seg, bs0, bs1, g->fmt, res[n - n0] + t, res[n + 1 - n0] + t);
                else btile2_4(at, g->K, w0, w1, seg, bs0, bs1, g->fmt, res[n - n0] + t, res[n + 1 - n0] + t);
                continue;
            }
            gemv_t rest = *g;
            rest.M = mt;
            rest.a = (const float *)at;
            row_dots_bf16(&rest, w0, seg, bs0, res[n - n0] + t);
            if (n + 1 < n1) {
                const float *bs1 = block ? g->ws + ((n + 1) / g->bn) * kblocks : NULL;
                row_dots_bf16(&rest, w0 + g->K, seg, bs1, res[n + 1 - n0] + t);
            }
        }
        t += mt;
    }
}
#endif

static void *gemv_worker(void *arg) {
    const gemv_t *g = (const gemv_t *)arg;
    float factor = g->a_bf16 ? 1.0f : dec_factor(g->fmt); /* bf16 products: exact values */
#if FP8_PATH == 4
    if (g->a_bf16 && g->M >= 8) {
        float res[CHUNK_MAX][16];
        int64_t ch = (128 * 1024) / g->K; /* ~128 KiB of fp8 weight per chunk (L2) */
        ch = ch < 2 ? 2 : ch > CHUNK_MAX ? CHUNK_MAX : ch;
        for (int64_t c = g->n0; c < g->n1; c += ch) {
            int64_t c1 = c + ch < g->n1 ? c + ch : g->n1;
            gemv_chunk_bf16(g, c, c1, res);
            for (int64_t n = c; n < c1; ++n) gemv_epilogue(g, n, res[n - c], factor);
        }
        return NULL;
    }
#endif
    float res[16];
    int64_t kblocks = (g->K + g->bk - 1) / g->bk;
    for (int64_t n = g->n0; n < g->n1; ++n) {
        int block = g->wgran == GRAN_BLOCK;
        const float *bs = block ? g->ws + (n / g->bn) * kblocks : NULL;
        int64_t seg = block ? g->bk : g->K;
#if FP8_PATH == 4
        if (g->a_bf16) row_dots_bf16(g, g->w + n * g->K, seg, bs, res);
        else
#endif
        row_dots(g, g->w + n * g->K, seg, bs, res);
        gemv_epilogue(g, n, res, factor);
    }
    return NULL;
}

/* torch's own OpenMP runtime, when the loader hands it over (fp8_set_openmp): the work runs
 * on torch's intra-op threads instead of new ones that would fight them for the cores. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
#if IN_PART(2) /* defined once: part 1 reads the value that part 2's fp8_set_openmp sets */
__attribute__((visibility("hidden"))) gomp_parallel_fn fp8_gomp_parallel = NULL;

void fp8_set_openmp(void *gomp_parallel) { fp8_gomp_parallel = (gomp_parallel_fn)gomp_parallel; }
#else
extern __attribute__((visibility("hidden"))) gomp_parallel_fn fp8_gomp_parallel;
#endif
#define GOMP_PARALLEL fp8_gomp_parallel

typedef struct {
    void *(*fn)(void *);
    char (*bufs)[256];
    int64_t nt, next;
} team_t;

static void team_body(void *p) { /* any team size: threads take shares until none is left */
    team_t *team = (team_t *)p;
    int64_t i;
    while ((i = __atomic_fetch_add(&team->next, 1, __ATOMIC_RELAXED)) < team->nt)
        team->fn(team->bufs[i]);
}

/* Split rows [0, n) over nthreads (the calling thread takes a share). */
static int run_split(void *(*fn)(void *), void *args, size_t size, int64_t n, int64_t nthreads,
                     void (*set_range)(void *, int64_t, int64_t)) {
    char buf[MAX_THREADS][256];
    pthread_t th[MAX_THREADS];
    int started[MAX_THREADS];
    if (size > sizeof(buf[0])) return -2;
    int64_t nt = nthreads < 1 ? 1 : nthreads > MAX_THREADS ? MAX_THREADS : nthreads;
    if (nt > n) nt = n < 1 ? 1 : n;
    for (int64_t i = 0; i < nt; ++i) {
        memcpy(buf[i], args, size);
        set_range(buf[i], n * i / nt, n * (i + 1) / nt);
    }
    if (nt == 1) {
        fn(buf[0]);
        return 0;
    }
    if (GOMP_PARALLEL) {
        team_t team = {fn, buf, nt, 0};
        GOMP_PARALLEL(team_body, &team, (unsigned)nt, 0);
        return 0;
    }
    for (int64_t i = 1; i < nt; ++i) started[i] = pthread_create(&th[i], NULL, fn, buf[i]) == 0;
    fn(buf[0]);
    for (int64_t i = 1; i < nt; ++i) {
        if (started[i]) pthread_join(th[i], NULL);
        else fn(buf[i]); /* could not start a thread: do its share here */
    }
    return 0;
}

static void gemv_range(void *p, int64_t n0, int64_t n1) {
    ((gemv_t *)p)->n0 = n0;
    ((gemv_t *)p)->n1 = n1;
}

#if IN_PART(2)
int fp8_gemv(const float *a, int64_t M, int64_t K, const uint8_t *w, int64_t N,
             const float *ws, int64_t wgran, int64_t bn, int64_t bk, const float *as,
             int64_t agran, const float *bias, void *out, int64_t out_kind, int64_t fmt,
             int64_t a_kind, int64_t nthreads) {
    if (M < 1 || M > 16 || K < 1 || N < 1 || bn < 1 || bk < 1 || (fmt != 0 && fmt != 1))
        return -1;
    if (a_kind != 0 && !(FP8_PATH == 4 && a_kind == 1)) return -1;
    pthread_once(&LUT_ONCE, lut_init);
    int nonfinite = 0;
    gemv_t g = {a, w, ws, as, bias, out, M, K, N, bn, bk, 0, N, (int)fmt, (int)wgran,
                (int)agran, (int)out_kind, (int)a_kind, &nonfinite};
    /* below ~64K weights per thread, starting a thread costs more than it saves */
    int64_t useful = (N * K) / 65536;
    if (nthreads > useful) nthreads = useful < 1 ? 1 : useful;
    int rc = run_split(gemv_worker, &g, sizeof g, N, nthreads, gemv_range);
    return rc ? rc : nonfinite; /* 1: done, some output is +-inf or NaN (see fp8_gemv's doc) */
}
#endif

/* ---------------------------------------------------------------- decode */
typedef struct {
    const uint8_t *w;  /* [rows, K] codes, rows r0.. of the full weight */
    const float *ws;   /* NULL: unscaled; else as in the GEMV, for the full weight */
    void *out;         /* [rows, K] bf16 or fp32 */
    int64_t K, row0, bn, bk, n0, n1;
    int fmt, wgran, out_kind;
} decode_t;

static void decode_span(const decode_t *d, const uint8_t *w, int64_t len, float scale,
                        float factor, void *out) {
    const float *lut = LUT[d->fmt];
    int64_t k = 0;
#if FP8_PATH == 4
    if (d->out_kind == OUT_BF16 && d->ws == NULL) { /* unscaled: the byte tables, exact */
        const __m512i hi0 = T_HI[d->fmt][0], hi1 = T_HI[d->fmt][1];
        const __m512i lo0 = T_LO[d->fmt][0], lo1 = T_LO[d->fmt][1], perm = PERM;
        for (; k + 64 <= len; k += 64) {
            __m512i o0, o1;
            dec64_bf16(w + k, hi0, hi1, lo0, lo1, perm, &o0, &o1);
            _mm512_storeu_si512((uint16_t *)out + k, o0);
            _mm512_storeu_si512((uint16_t *)out + k + 32, o1);
        }
        if (k < len) { /* the last 1..63 codes: masked loads and stores, same tables */
            int64_t left = len - k;
            __mmask64 lm = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
            __m512i o0, o1;
            dec64_bf16_v(_mm512_maskz_loadu_epi8(lm, w + k), hi0, hi1, lo0, lo1, perm, &o0, &o1);
            _mm512_mask_storeu_epi16((uint16_t *)out + k, (__mmask32)lm, o0);
            _mm512_mask_storeu_epi16((uint16_t *)out + k + 32, (__mmask32)(lm >> 32), o1);
            k = len;
        }
    } else if (d->out_kind == OUT_BF16) { /* scaled: exact values from the tables, one fp32
        multiply, vcvtne2ps2bf16 (round to nearest even); lanes that instruction would treat
        otherwise than torch (fp32 subnormals: flushed; NaN: torch's 0x7fc0) go the long way */
        const __m512i hi0 = T_HI[d->fmt][0], hi1 = T_HI[d->fmt][1];
        const __m512i lo0 = T_LO[d->fmt][0], lo1 = T_LO[d->fmt][1], perm = PERM;
        const __m512i expo = _mm512_set1_epi32(0x7f800000), mag = _mm512_set1_epi32(0x7fffffff);
        const __m512 sv = _mm512_set1_ps(scale);
        for (; k + 64 <= len; k += 64) {
            __m512i o[2];
            dec64_bf16(w + k, hi0, hi1, lo0, lo1, perm, &o[0], &o[1]);
            for (int h = 0; h < 2; ++h) {
                __m512 a = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(o[h])), 16));
                __m512 b = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(o[h], 1)), 16));
                a = _mm512_mul_ps(a, sv);
                b = _mm512_mul_ps(b, sv);
                __m512i ua = _mm512_castps_si512(a), ub = _mm512_castps_si512(b);
                __m512i ea = _mm512_and_si512(ua, expo), eb = _mm512_and_si512(ub, expo);
                __mmask16 odd = _mm512_mask_test_epi32_mask(_mm512_cmpeq_epi32_mask(ea, _mm512_setzero_si512()), ua, mag)
                                | _mm512_cmpeq_epi32_mask(ea, expo)
                                | _mm512_mask_test_epi32_mask(_mm512_cmpeq_epi32_mask(eb, _mm512_setzero_si512()), ub, mag)
                                | _mm512_cmpeq_epi32_mask(eb, expo);
                uint16_t *dst = (uint16_t *)out + k + 32 * h;
                if (odd) {
                    vstore_bf16(dst, a);
                    vstore_bf16(dst + 16, b);
                } else {
                    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
                }
            }
        }
    }
#endif
#if FP8_PATH != 0
    vf f = vset(factor), s = vset(scale);
    for (; k + 2 * VL <= len; k += 2 * VL) {
        vf lo, hi;
        vdec(w + k, d->fmt, &lo, &hi);
        lo = vmul(vmul(lo, f), s); /* exact, then the one rounding of torch's x * scale */
        hi = vmul(vmul(hi, f), s);
        if (d->out_kind == OUT_BF16) {
            vstore_bf16((uint16_t *)out + k, lo);
            vstore_bf16((uint16_t *)out + k + VL, hi);
        } else {
            vstore((float *)out + k, lo);
            vstore((float *)out + k + VL, hi);
        }
    }
#endif
    for (; k < len; ++k) {
        float v = (lut[w[k]] * factor) * scale;
        if (d->out_kind == OUT_BF16) ((uint16_t *)out)[k] = f32_to_bf16(v);
        else ((float *)out)[k] = v;
    }
}

static void *decode_worker(void *arg) {
    const decode_t *d = (const decode_t *)arg;
    float factor = dec_factor(d->fmt);
    int64_t kblocks = (d->K + d->bk - 1) / d->bk;
    size_t esz = d->out_kind == OUT_BF16 ? 2 : 4;
    for (int64_t r = d->n0; r < d->n1; ++r) {
        const uint8_t *w = d->w + r * d->K;
        char *out = (char *)d->out + (size_t)(r * d->K) * esz;
        int64_t n = d->row0 + r;
        if (d->ws == NULL || d->wgran != GRAN_BLOCK) {
            float s = d->ws == NULL ? 1.0f : d->wgran == GRAN_ROW ? d->ws[n] : d->ws[0];
            decode_span(d, w, d->K, s, factor, out);
            continue;
        }
        for (int64_t k0 = 0, b = 0; k0 < d->K; k0 += d->bk, ++b) {
            int64_t len = k0 + d->bk < d->K ? d->bk : d->K - k0;
            decode_span(d, w + k0, len, d->ws[(n / d->bn) * kblocks + b], factor,
                        out + (size_t)k0 * esz);
        }
    }
    return NULL;
}

static void decode_range(void *p, int64_t n0, int64_t n1) {
    ((decode_t *)p)->n0 = n0;
    ((decode_t *)p)->n1 = n1;
}

#if IN_PART(1)
/* Decode rows [row0, row0 + rows) of a [*, K] fp8 weight (w points at row0) into out. */
int fp8_decode(const uint8_t *w, int64_t rows, int64_t K, int64_t row0, const float *ws,
               int64_t wgran, int64_t bn, int64_t bk, void *out, int64_t out_kind, int64_t fmt,
               int64_t nthreads) {
    if (rows < 0 || K < 1 || bn < 1 || bk < 1 || (fmt != 0 && fmt != 1)) return -1;
    pthread_once(&LUT_ONCE, lut_init);
    decode_t d = {w, ws, out, K, row0, bn, bk, 0, rows, (int)fmt, (int)wgran, (int)out_kind};
    int64_t useful = (rows * K) / 262144;
    if (nthreads > useful) nthreads = useful < 1 ? 1 : useful;
    return run_split(decode_worker, &d, sizeof d, rows, nthreads, decode_range);
}
#endif

/* ---------------------------------------------------------------- activation quantization */
/* hf_fp8.numerics, operation by operation: amax of the finite |x| (per tensor, token or
 * 1 x bk block), scale = max(amax / fp8_max, floor) (floor: numerics.min_scale()),
 * q = RNE_fp8(clamp(x / scale, +-max))
 * (NaN for a non-finite x, and for every x where a given scale is not > 0: 0, < 0, NaN;
 * a finite x saturates, also where x / scale overflows fp32);
 * out = q (post) or q * scale rounded once (block: folded). */
typedef struct {
    const void *x;       /* [M, K] fp32 or bf16 */
    float *scale;        /* [1], [M] or [M, kblocks]: computed, or given (static) */
    void *out;           /* [M, K] fp32 or bf16 */
    int64_t M, K, bk, n0, n1;
    int x_bf16, gran, fmt, out_kind, post, phase, given;
    float floor;
} quant_t;

AI float load_x(const quant_t *q, int64_t i) {
    if (q->x_bf16) return bf16_bits_to_f32(((const uint16_t *)q->x)[i]);
    return ((const float *)q->x)[i];
}

/* The fp8 value nearest to a finite |x| <= fp8 max, ties to even (as torch's cast). */
AI float fp8_round(float x, int fmt) {
    float a = fabsf(x), r;
    if (a < (fmt == FMT_E4M3 ? 0x1p-6f : 0x1p-14f)) { /* subnormal grid: fixed spacing */
        float inv = fmt == FMT_E4M3 ? 0x1p9f : 0x1p16f;
        r = ((a * inv + 12582912.0f) - 12582912.0f) / inv;
    } else { /* keep 3 (E4M3) or 2 (E5M2) mantissa bits, round half to even */
        int sh = fmt == FMT_E4M3 ? 20 : 21;
        uint32_t u;
        memcpy(&u, &a, 4);
        u = (u + ((1u << (sh - 1)) - 1u) + ((u >> sh) & 1u)) & ~((1u << sh) - 1u);
        memcpy(&r, &u, 4);
    }
    return copysignf(r, x);
}

#define QCHUNK 256

#if FP8_PATH >= 3
/* The per-element loop of quant_worker below, 16 lanes: q = RNE_fp8(clamp(x / scale,
 * +-fmax)) as fp32 bits, the same quotient, clamp and sign (NaN for a non-finite x or a
 * scale not > 0; a finite x whose quotient overflows saturates; allfin: the caller knows
 * every x is finite and the scale > 0). The
 * rounding to the fp8 grid (ties to even) by one addition and one subtraction of
 * m = 1.5 * 2^(e + 20) (E4M3; 2^(e + 21) for E5M2),
 * e = max(exponent of a, min normal exponent): a + m stays in m's binade, whose ulp is the
 * fp8 spacing 2^(e - 3) (2^(e - 2)), so the sum rounds a to that grid, ties to even (m is an
 * even multiple of the spacing), and subtracting m is exact; below the normal range the
 * fixed subnormal spacing. m is built from a's exponent bits with integer operations. */
AI __m512i quant16(__m512 x, __m512 vs, int e4, int allfin) {
    const __m512 vmax = _mm512_set1_ps(e4 ? 448.0f : 57344.0f);
    const __m512i minnorm = _mm512_set1_epi32(e4 ? 0x3c800000 : 0x38800000); /* 2^-6, 2^-14 */
    const __m512i shift = _mm512_set1_epi32(((e4 ? 20 : 21) << 23) | 0x400000);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff);
    __m512 v = _mm512_div_ps(x, vs);
    /* min(|v|, fmax), sign cleared: the clamp and the abs in one (NaN: below) */
    __m512 a = _mm512_range_ps(v, vmax, 0x0a);
    __m512i eb = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(a),
                                                   _mm512_set1_epi32(0x7f800000)), minnorm);
    __m512 m = _mm512_castsi512_ps(_mm512_add_epi32(eb, shift));
    __m512 r = _mm512_sub_ps(_mm512_add_ps(a, m), m);
    __m512i ru = _mm512_ternarylogic_epi32(_mm512_castps_si512(r), _mm512_castps_si512(v), abs,
                                           0xf4); /* | sign(v) */
    if (!allfin) { /* NaN unless x is finite and scale > 0 (not zero, negative or NaN) */
        __mmask16 pos = _mm512_cmp_ps_mask(vs, _mm512_setzero_ps(), _CMP_GT_OQ);
        __mmask16 fin = _mm512_mask_cmplt_epu32_mask(
            pos, _mm512_and_si512(_mm512_castps_si512(x), abs), _mm512_set1_epi32(0x7f800000));
        ru = _mm512_mask_blend_epi32(fin, _mm512_set1_epi32(0x7fc00000), ru);
    }
    return ru;
}

/* 32 bf16 activations quantized (quant16), the fp8 values as bf16 bits in the same places:
 * to fp32 by 16-bit unpacks and back by one pack (in-lane; the pack restores the order the
 * unpacks took apart; fp8 values are exact bf16). */
AI __m512i quant32_bf16(__m512i xw, __m512 vs, int e4, int allfin) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i lo = quant16(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, xw)), vs, e4, allfin);
    __m512i hi = quant16(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, xw)), vs, e4, allfin);
    return _mm512_packus_epi32(_mm512_srli_epi32(lo, 16), _mm512_srli_epi32(hi, 16));
}
#endif

/* The per-tensor scale from the rows' amax (fp8_quant_act's phase 0): max(amax / fmax, floor). */
static inline float tensor_scale(const float *rowmax, int64_t M, int fmt, float floor) {
    float amax = 0.0f;
    for (int64_t m = 0; m < M; ++m) amax = rowmax[m] > amax ? rowmax[m] : amax;
    float s = amax / (fmt == FMT_E4M3 ? 448.0f : 57344.0f);
    return s < floor ? floor : s;
}

/* Branch-free loops over chunks, so that the compiler vectorizes them on paths 0-2 (division
 * included: x / scale must be the correctly rounded quotient, as torch's, not x * (1 / scale)).
 * AVX-512 paths write the vector loops out and leave only short tails to the scalar loops:
 * there auto-vectorization is off (it cost 0.2 s of the build per part, for no speed). */
#if FP8_PATH >= 3
__attribute__((optimize("no-tree-vectorize")))
#endif
static void *quant_worker(void *arg) {
    const quant_t *q = (const quant_t *)arg;
    const int e4 = q->fmt == FMT_E4M3;
    const float fmax = e4 ? 448.0f : 57344.0f, minnorm = e4 ? 0x1p-6f : 0x1p-14f;
    const float inv = e4 ? 0x1p9f : 0x1p16f, rinv = e4 ? 0x1p-9f : 0x1p-16f;
    const int sh = e4 ? 20 : 21; /* fp32 mantissa bits dropped: keep 3 (E4M3) or 2 (E5M2) */
    const uint32_t half = (1u << (sh - 1)) - 1u, keep = ~((1u << sh) - 1u);
    int64_t kb = (q->K + q->bk - 1) / q->bk, seg = q->gran == GRAN_BLOCK ? q->bk : q->K;
    float xf[QCHUNK], r[QCHUNK];
    uint32_t ub[QCHUNK];
    for (int64_t m = q->n0; m < q->n1; ++m) {
        for (int64_t k0 = 0, b = 0; k0 < q->K; k0 += seg, ++b) {
            int64_t k1 = k0 + seg < q->K ? k0 + seg : q->K;
            float *sp = q->gran == GRAN_TENSOR ? q->scale
                        : q->gran == GRAN_ROW  ? q->scale + m
                                               : q->scale + m * kb + b;
            /* phase 2 (token / block scales): both phases per segment, while it is in L1 */
            uint32_t nonfin = 0; /* phase 0 met a NaN / inf (phase 2: skip the check after) */
            for (int ph = q->phase == 2 ? 0 : q->phase; ph <= (q->phase == 2 ? 1 : q->phase); ++ph) {
                float scale = ph ? *sp : 1.0f;
                const int usable = scale > 0.0f; /* a given scale of 0, < 0 or NaN: all NaN */
                uint32_t umax = 0; /* |x| of finite values as bits: they order like the floats */
                for (int64_t c0 = k0; c0 < k1; c0 += QCHUNK) {
                    int64_t n = k1 - c0 < QCHUNK ? k1 - c0 : QCHUNK, at = m * q->K + c0, nv = 0;
#if FP8_PATH >= 3
                    nv = n & ~(int64_t)15; /* the vector loops read the input directly */
#endif
                    if (q->x_bf16) { /* the rest as fp32 in xf */
                        const uint16_t *xb = (const uint16_t *)q->x + at;
                        for (int64_t i = nv; i < n; ++i) ub[i] = (uint32_t)xb[i] << 16;
                        memcpy(xf + nv, ub + nv, (size_t)(n - nv) * 4);
                    } else {
                        memcpy(xf + nv, (const float *)q->x + at + nv, (size_t)(n - nv) * 4);
                    }
                    if (ph == 0) {
                        uint32_t cm = 0;
                        int64_t i = 0;
#if FP8_PATH >= 3
                        __m512i vm = _mm512_setzero_si512();
                        if (q->x_bf16) { /* 32 bf16 at a time: |x| bits as 16-bit lanes */
                            const uint16_t *xb16 = (const uint16_t *)q->x + at;
                            __m512i vh = _mm512_setzero_si512();
                            for (; i + 32 <= n; i += 32) {
                                __m512i u = _mm512_and_si512(_mm512_loadu_si512(xb16 + i),
                                                             _mm512_set1_epi16(0x7fff));
                                __mmask32 fin = _mm512_cmplt_epu16_mask(u, _mm512_set1_epi16(0x7f80));
                                vh = _mm512_mask_max_epu16(vh, fin, vh, u);
                                nonfin |= (uint32_t)~fin;
                            }
                            vm = _mm512_slli_epi32(_mm512_max_epu32(_mm512_srli_epi32(vh, 16),
                                                                    _mm512_and_si512(vh, _mm512_set1_epi32(0xffff))),
                                                   16);
                        }
                        for (; i + 16 <= n; i += 16) {
                            __m512i xi = q->x_bf16
                                ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                      (const __m256i *)((const uint16_t *)q->x + at + i))), 16)
                                : _mm512_loadu_si512((const float *)q->x + at + i);
                            __m512i u = _mm512_and_si512(xi, _mm512_set1_epi32(0x7fffffff));
                            __mmask16 fin = _mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(0x7f800000));
                            vm = _mm512_mask_max_epu32(vm, fin, vm, u);
                            nonfin |= (uint32_t)(uint16_t)~fin;
                        }
                        cm = _mm512_reduce_max_epu32(vm);
#elif FP8_PATH == 2
                        __m256i vm = _mm256_setzero_si256();
                        for (; i + 8 <= n; i += 8) {
                            __m256i u = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xf + i)),
                                                         _mm256_set1_epi32(0x7fffffff));
                            __m256i fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), u);
                            vm = _mm256_max_epu32(vm, _mm256_and_si256(u, fin));
                        }
                        uint32_t lanes[8];
                        _mm256_storeu_si256((__m256i *)lanes, vm);
                        for (int j = 0; j < 8; ++j) cm = lanes[j] > cm ? lanes[j] : cm;
#endif
                        for (; i < n; ++i) {
                            uint32_t u;
                            memcpy(&u, xf + i, 4);
                            u &= 0x7fffffffu;
                            nonfin |= u >= 0x7f800000u;
                            u = u < 0x7f800000u ? u : 0u; /* NaN and inf never enter a scale */
                            cm = u > cm ? u : cm;
                        }
                        umax = cm > umax ? cm : umax;
                        continue;
                    }
                    int64_t i0 = 0;
#if FP8_PATH >= 3
                    { /* the scalar loop below, 16 lanes at a time (quant16), straight from the
                         input */
                        const __m512 vs = _mm512_set1_ps(scale);
                        const uint16_t *xb16 = (const uint16_t *)q->x + at;
                        const float *xf32 = (const float *)q->x + at;
                        /* a scale from this segment's finite amax (> 0) keeps every quotient of
                           finite values finite: |x / scale| <= fmax (1 + 2^-23) */
                        const int allfin = q->phase == 2 && !nonfin && scale > 0.0f;
                        if (q->x_bf16 && q->post && q->out_kind == OUT_BF16)
                            for (; i0 + 32 <= n; i0 += 32)
                                _mm512_storeu_si512((uint16_t *)q->out + at + i0,
                                                    quant32_bf16(_mm512_loadu_si512(xb16 + i0), vs,
                                                                 e4, allfin));
                        for (; i0 + 16 <= n; i0 += 16) {
                            __m512 xv = q->x_bf16
                                ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb16 + i0))), 16))
                                : _mm512_loadu_ps(xf32 + i0);
                            __m512i ru = quant16(xv, vs, e4, allfin);
                            if (q->post && q->out_kind == OUT_BF16) { /* fp8 values are exact bf16 */
                                _mm256_storeu_si256((__m256i *)((uint16_t *)q->out + at + i0),
                                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(ru, 16)));
                                continue;
                            }
                            __m512 out = _mm512_castsi512_ps(ru);
                            if (!q->post) out = _mm512_mul_ps(out, vs);
                            if (q->out_kind == OUT_BF16) vstore_bf16((uint16_t *)q->out + at + i0, out);
                            else _mm512_storeu_ps((float *)q->out + at + i0, out);
                        }
                    }
#endif
                    for (int64_t i = i0; i < n; ++i) {
                        float v = xf[i] / scale;
                        float c = v < -fmax ? -fmax : (v > fmax ? fmax : v);
                        float a = fabsf(c), nor, vv;
                        uint32_t u, uv;
                        memcpy(&u, &a, 4);
                        u = (u + half + ((u >> sh) & 1u)) & keep; /* round half to even */
                        memcpy(&nor, &u, 4);
                        float sub = ((a * inv + 12582912.0f) - 12582912.0f) * rinv; /* fixed grid */
                        float rr = copysignf(a < minnorm ? sub : nor, c);
                        vv = xf[i]; /* a finite x saturates, even where x / scale overflows */
                        memcpy(&uv, &vv, 4);
                        /* NaN for a non-finite x or a scale that is not > 0 (0, < 0, NaN) */
                        rr = (uv & 0x7fffffffu) < 0x7f800000u && usable ? rr : NAN;
                        r[i] = q->post ? rr : rr * scale;
                    }
                    if (q->out_kind == OUT_BF16) {
                        uint16_t *o = (uint16_t *)q->out + at;
                        memcpy(ub + i0, r + i0, (size_t)(n - i0) * 4);
                        for (int64_t i = i0; i < n; ++i) {
                            uint32_t u = ub[i];
                            uint32_t h = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
                            o[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : h);
                        }
                    } else {
                        memcpy((float *)q->out + at + i0, r + i0, (size_t)(n - i0) * 4);
                    }
                }
                if (ph == 0) {
                    float amax;
                    memcpy(&amax, &umax, 4);
                    if (q->gran == GRAN_TENSOR) ((float *)q->out)[m] = amax;
                    else *sp = amax / fmax < q->floor ? q->floor : amax / fmax;
                }
            }
        }
    }
    return NULL;
}

static void quant_range(void *p, int64_t n0, int64_t n1) {
    ((quant_t *)p)->n0 = n0;
    ((quant_t *)p)->n1 = n1;
}

#if IN_PART(2)
/* Fake-quantize an [M, K] activation. scale: [1] (tensor), [M] (row) or [M, ceil(K/bk)]
 * (block); read when `given` (static), else written. A tensor amax is reduced through
 * `out` (>= M floats of scratch) before the second pass overwrites it. */
int fp8_quant_act(const void *x, int64_t x_bf16, int64_t M, int64_t K, int64_t gran,
                  int64_t bk, int64_t fmt, float *scale, int64_t given, void *out,
                  int64_t out_kind, int64_t post, float floor, int64_t nthreads) {
    if (M < 1 || K < 1 || bk < 1 || (fmt != 0 && fmt != 1) || gran < 0 || gran > 2) return -1;
    if (gran == GRAN_TENSOR && !given && out_kind != OUT_F32 && K < 2) return -1;
    quant_t q = {x, scale, out, M, K, bk, 0, M, (int)x_bf16, (int)gran, (int)fmt,
                 (int)out_kind, (int)post, 0, (int)given, floor};
    int64_t useful = (M * K) / 65536;
    if (nthreads > useful) nthreads = useful < 1 ? 1 : useful;
    if (!given && gran != GRAN_TENSOR) { /* a scale per token / block: one pass per row */
        q.phase = 2;
        return run_split(quant_worker, &q, sizeof q, M, nthreads, quant_range);
    }
    if (!given) {
        float *rowmax = (float *)out; /* tensor: per-row amax in the output buffer */
        int rc = run_split(quant_worker, &q, sizeof q, M, nthreads, quant_range);
        if (rc) return rc;
        if (gran == GRAN_TENSOR) scale[0] = tensor_scale(rowmax, M, (int)fmt, floor);
    }
    q.phase = 1;
    return run_split(quant_worker, &q, sizeof q, M, nthreads, quant_range);
}
#endif

/* ---------------------------------------------------------------- matmul epilogue */
/* The emulation's epilogue on a transposed bf16 product acc_t [N, M]:
 *   out[m, n] = bf16((float(acc_t[n, m]) * (a_scale[m] * w_scale[n])) + float(bias[n]))
 * (a_scale / w_scale / bias optional; a_scale [1] or [M], w_scale [1] or [N]). */
typedef struct {
    const uint16_t *acc_t, *bias;
    const float *as, *ws;
    uint16_t *out;
    int64_t M, N, n0, n1, as_n, ws_n;
    int *nonfinite;
} epi_t;

static NO_UNSWITCH void *epi_worker(void *arg) {
    const epi_t *e = (const epi_t *)arg;
    int bad = 0;
    for (int64_t b0 = e->n0 * 32; b0 < e->n1 * 32 && b0 < e->N; b0 += 32) {
        int64_t b1 = b0 + 32 < e->N ? b0 + 32 : e->N;
        for (int64_t m = 0; m < e->M; ++m) {
            float am = e->as ? e->as[e->as_n == 1 ? 0 : m] : 1.0f;
            for (int64_t n = b0; n < b1; ++n) {
                float v = bf16_bits_to_f32(e->acc_t[n * e->M + m]);
                if (e->as && e->ws) v = v * (am * e->ws[e->ws_n == 1 ? 0 : n]);
                else if (e->as) v = v * am;
                else if (e->ws) v = v * e->ws[e->ws_n == 1 ? 0 : n];
                if (e->bias) v = v + bf16_bits_to_f32(e->bias[n]);
                bad |= !isfinite(v);
                e->out[m * e->N + n] = f32_to_bf16(v);
            }
        }
    }
    if (bad) __atomic_store_n(e->nonfinite, 1, __ATOMIC_RELAXED);
    return NULL;
}

static void epi_range(void *p, int64_t n0, int64_t n1) {
    ((epi_t *)p)->n0 = n0;
    ((epi_t *)p)->n1 = n1;
}

#if IN_PART(2)
int fp8_epilogue(const uint16_t *acc_t, int64_t M, int64_t N, const float *as, int64_t as_n,
                 const float *ws, int64_t ws_n, const uint16_t *bias, uint16_t *out,
                 int64_t nthreads) {
    if (M < 1 || N < 1 || (as && as_n != 1 && as_n != M) || (ws && ws_n != 1 && ws_n != N))
        return -1;
    int nonfinite = 0;
    epi_t e = {acc_t, bias, as, ws, out, M, N, 0, 0, as_n, ws_n, &nonfinite};
    int64_t blocks = (N + 31) / 32, useful = (M * N) / 65536;
    if (nthreads > useful) nthreads = useful < 1 ? 1 : useful;
    int rc = run_split(epi_worker, &e, sizeof e, blocks, nthreads, epi_range);
    return rc ? rc : nonfinite; /* 1: done, some output is +-inf or NaN */
}
#endif

/* ---------------------------------------------------------------- fused decode + GEMM (path 4) */
/* out[m, n] = epilogue(bf16(sum_k x[m, k] * w[n, k])) for many tokens, bf16 activations:
 * a register-blocked GEMM with vdpbf16ps, MM_MR weight rows x MM_TT tokens per micro-tile.
 * The weight is the broadcast operand: a (k, k + 1) pair of a row is what the instruction
 * broadcasts, and rows are already laid out that way, so a panel of MM_MR rows is only
 * decoded (fp8 -> bf16, into L1), never transposed; the activations, far fewer than the
 * weights at these sizes, are packed once per call into pairs-of-k x tokens (by all threads
 * together, see mm_share_t; with fp8 activations fake-quantized on the way, the dynamic
 * scales computed first, see mm_amax_t). The sum is the
 * bf16 matmul's (exact bf16 products, fp32 sums, one rounding to bf16), then the epilogue
 * of fp8_epilogue: bf16((acc * (a_scale[m] * w_scale[n])) + bias[n]).
 * Blocking: per thread, chunks of MM_NC weight rows; their fp32 partial sums [MM_NC, MM_MC]
 * stay in L2 across K blocks (K split into blocks of at most MM_KC; large blocks keep
 * the micro-tile's prologue and epilogue rare). With unscaled codes (per-tensor / per-row
 * scales applied after the matmul) the next panel is decoded inside the current panel's last
 * token tile, 64 codes a row after every 32 k-pairs, where the decode's shuffles overlap the
 * dot products (a separate decode pass cost ~3 % at M = 256, K = 5632). K must be even (the
 * Python side checks). */
#if FP8_PATH == 4
#ifndef MM_KC /* the largest K block; overridable for tuning builds only */
#define MM_KC 1024
#endif
_Static_assert(MM_KC % 64 == 0, "K blocks are multiples of 64 codes");
#define MM_MR 14            /* weight rows per micro-tile (28 accumulators) */
_Static_assert(MM_MR == 14, "mmk_*_14 is the full panel");
#define MM_TT 32            /* tokens per micro-tile: two vectors */
#ifndef MM_NC /* weight rows per chunk: their partial sums (224 KiB at 256 tokens) share the */
#define MM_NC (MM_MR * 16) /* L2 with a K block of packed activations (~470 KiB at K = 5632) */
#endif
#ifndef MM_MC
#define MM_MC 256           /* tokens per block */
#endif
#define MM_WLD MM_KC /* row stride of the decoded panel (bf16 elements); padding it (or the
                        packed activations' pair stride) by 64 bytes measured no different */

typedef struct {
    const uint16_t *x;    /* [M, K] bf16 */
    const uint8_t *w;     /* [N, K] fp8 codes */
    const float *ws;      /* folded into the decode (NULL: unscaled codes) */
    const float *as, *ps; /* post scales: activation [1] / [M], weight [1] / [N]; or NULL */
    const uint16_t *bias; /* [N] bf16 or NULL */
    uint16_t *out;        /* [M, N] bf16 */
    int *err;             /* bit 0: a worker could not allocate its scratch; bit 1: an output
                             is not finite */
    int64_t M, K, N, bn, bk, n0, n1, as_n, ps_n;
    int64_t kc;           /* K block: at most MM_KC, a multiple of 64 (the last one shorter) */
    int64_t mc0, mc, mcp, ldx; /* the token block mm_pack_x packs (pair stride ldx) */
    int fmt, wgran;
    int qfmt;             /* >= 0: quantize x to this fp8 format first: dynamic (am) */
    const float *qscale;  /*   or with this given scale [1] (static; then also the post scale) */
    float qfloor;         /* its scale floor */
    float qs;             /* a thread's copy of the dynamic per-tensor scale (qscale, as: &qs) */
    struct mm_amax *am;   /* dynamic scales: computed by all threads first, or NULL */
    struct mm_share *sh;  /* one token block: the packing shared by the threads, or NULL */
} mm_t;
_Static_assert(sizeof(mm_t) <= 256, "run_split copies at most 256 bytes of arguments");

/* Dynamic scales, before any packing: fp8_quant_act's phase 0 over all M tokens (16 a unit)
 * by all threads together, units claimed in order from an atomic counter like the packing's
 * (mm_share_t: a thread only waits for units another thread is in the middle of). Per token
 * (gran row) it writes the token scales; per tensor each thread then reduces the row maxima
 * to the scale itself (the same value in every thread). Every token block is then packed
 * (and quantized) K block by K block, right before its first use, as without quantization. */
typedef struct mm_amax {
    float *out; /* [M]: the token scales (row) or the rows' amax (tensor) */
    int64_t next, done, units;
    int gran;
} mm_amax_t;

/* The packing shared by the threads (a single token block): the packed activations exist
 * once, in the calling thread's scratch. Threads claim pack units in
 * order from an atomic counter; before each K block a thread helps until that block's units
 * are done, so it only ever waits for units another thread is in the middle of (a few
 * microseconds), never for a thread that has not reached the packing (no barrier: a thread
 * preempted by another process cannot hold the others up for a scheduler slice). A unit:
 * 16 tokens of one K block. */
typedef struct mm_share {
    uint32_t *xp;
    int64_t *done; /* units done per K block */
    int64_t next, units, groups;
} mm_share_t;

/* 16 x 16 transpose of 32-bit elements (rows r[0..15] -> columns). */
AI void tr16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int q = 0; q < 4; ++q) {
        __m512i u0 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x88);
        __m512i u1 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xdd);
        __m512i u2 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x88);
        __m512i u3 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xdd);
        t[q] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[8 + q] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
        t[4 + q] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + q] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/* Tokens [m0, m0 + 16) of the token block (rows of them real, from src, stride K) into xp,
 * K blocks [b0, b1): per K block b, [pairs][ldx] 32-bit (k, k + 1) pairs of each token
 * (missing tokens: zeros). qs: NULL, or each row's scale: the values are fake-quantized on
 * the way (quant32_bf16, fp8_quant_act's own operations: the same bits, no temporary). */
static void mm_pack_rows(const mm_t *g, const uint16_t *src, int64_t m0, int64_t rows,
                         int64_t b0, int64_t b1, uint32_t *xp, const float *qs) {
    for (int64_t b = b0, k0 = b0 * g->kc; b < b1 && k0 < g->K; k0 += g->kc, ++b) {
        int64_t pairs = (g->K - k0 < g->kc ? g->K - k0 : g->kc) / 2;
        uint32_t *dst = xp + b * (g->kc / 2) * g->ldx;
        for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
            int64_t jn = pairs - j0 < 16 ? pairs - j0 : 16;
            __mmask16 km = (__mmask16)((1u << jn) - 1u);
            __m512i r[16];
            /* rows 2 K bytes apart, 64 bytes of each: the hardware prefetcher lags behind 16
               such streams (at K = 5632 the packing took 30 % longer without this) */
            for (int i = 0; i < rows; ++i)
                _mm_prefetch((const char *)(src + i * g->K + k0 + 2 * j0 + 128), _MM_HINT_T0);
            for (int i = 0; i < 16; ++i)
                r[i] = i < rows ? _mm512_maskz_loadu_epi32(km, src + i * g->K + k0 + 2 * j0)
                                : _mm512_setzero_si512();
            if (qs) /* the masked-off pairs: 0 / scale = 0 */
                for (int i = 0; i < rows; ++i)
                    r[i] = quant32_bf16(r[i], _mm512_set1_ps(qs[i]), g->qfmt == FMT_E4M3, 0);
            tr16x16(r);
            for (int64_t j = 0; j < jn; ++j) _mm512_storeu_si512(dst + (j0 + j) * g->ldx + m0, r[j]);
        }
    }
}

/* The token block [mc0, mc0 + mc) into xp (tokens mc .. mcp, a multiple of 16: zeros), 16
 * tokens at a time; with qfmt >= 0 fake-quantized while packed, as fp8_quant_act(post, bf16
 * out) does, with the per-tensor scale (given, or the dynamic one) or the token scales
 * (g->as, from mm_amax), so they are the same bits. */
static void mm_pack_group(const mm_t *g, int64_t m0, int64_t b0, int64_t b1, uint32_t *xp) {
    int64_t rows = g->mc - m0 < 16 ? g->mc - m0 : 16;
    float qs[16];
    const float *s = NULL;
    if (g->qfmt >= 0 && g->qscale) {
        for (int i = 0; i < 16; ++i) qs[i] = g->qscale[0];
        s = qs;
    } else if (g->qfmt >= 0) {
        s = g->as + g->mc0 + m0;
    }
    mm_pack_rows(g, g->x + (g->mc0 + m0) * g->K, m0, rows, b0, b1, xp, s);
}

static void mm_pack_x(const mm_t *g, uint32_t *xp) {
    int64_t kblocks = (g->K + g->kc - 1) / g->kc;
    for (int64_t m0 = 0; m0 < g->mcp; m0 += 16) mm_pack_group(g, m0, 0, kblocks, xp);
}

/* Dynamic scales: return once every unit of mm_amax_t is done, helping meanwhile. */
static void mm_amax(const mm_t *g, mm_amax_t *am) {
    while (__atomic_load_n(&am->done, __ATOMIC_ACQUIRE) < am->units) {
        int64_t u = __atomic_load_n(&am->next, __ATOMIC_RELAXED) < am->units
                        ? __atomic_fetch_add(&am->next, 1, __ATOMIC_RELAXED)
                        : am->units;
        if (u >= am->units) { /* all claimed: another thread is finishing one */
            _mm_pause();
            continue;
        }
        int64_t r0 = u * 16, rows = g->M - r0 < 16 ? g->M - r0 : 16;
        /* phase 0: per token the scales into out (as scale), per tensor each row's amax */
        quant_t q = {g->x + r0 * g->K, am->out + r0, am->out + r0, rows, g->K, g->K, 0, rows,
                     1, am->gran, g->qfmt, OUT_F32, 1, 0, 0, g->qfloor};
        quant_worker(&q);
        __atomic_fetch_add(&am->done, 1, __ATOMIC_RELEASE);
    }
}

/* Shared packing: return once K block kb is packed (see mm_share_t), helping meanwhile. */
static void mm_share_wait(const mm_t *g, mm_share_t *sh, int64_t kb) {
    while (__atomic_load_n(&sh->done[kb], __ATOMIC_ACQUIRE) < sh->groups) {
        int64_t u = __atomic_load_n(&sh->next, __ATOMIC_RELAXED) < sh->units
                        ? __atomic_fetch_add(&sh->next, 1, __ATOMIC_RELAXED)
                        : sh->units;
        if (u >= sh->units) { /* all claimed: another thread is finishing one */
            _mm_pause();
            continue;
        }
        int64_t grp = u % sh->groups, b = u / sh->groups;
        mm_pack_group(g, grp * 16, b, b + 1, sh->xp);
        __atomic_fetch_add(&sh->done[b], 1, __ATOMIC_RELEASE);
    }
}

/* Weight rows [p0, p0 + rows) x codes [k0 + c0, k0 + kc) decoded to bf16 into columns
 * c0 .. kc of wb[MM_MR][MM_WLD] (rows past `rows`: zeros in columns 0 .. kc). */
static void mm_decode_panel_cols(const mm_t *g, int64_t p0, int64_t rows, int64_t k0,
                                 int64_t c0, int64_t kc, uint16_t *wb) {
    int64_t kblocks = (g->K + g->bk - 1) / g->bk;
    decode_t d = {NULL, g->ws, NULL, g->K, 0, g->bn, g->bk, 0, 0, g->fmt, g->wgran, OUT_BF16};
    float factor = dec_factor(g->fmt);
    for (int64_t r = 0; r < MM_MR; ++r) {
        uint16_t *row = wb + r * MM_WLD;
        int64_t n = p0 + r;
        if (r >= rows) {
            memset(row, 0, (size_t)kc * 2);
            continue;
        }
        if (g->ws == NULL || g->wgran != GRAN_BLOCK) {
            float s = g->ws == NULL ? 1.0f : g->wgran == GRAN_ROW ? g->ws[n] : g->ws[0];
            decode_span(&d, g->w + n * g->K + k0 + c0, kc - c0, s, factor, row + c0);
            continue;
        }
        for (int64_t k = k0 + c0; k < k0 + kc;) {
            int64_t b = k / g->bk, end = (b + 1) * g->bk;
            end = end < k0 + kc ? end : k0 + kc;
            decode_span(&d, g->w + n * g->K + k, end - k, g->ws[(n / g->bn) * kblocks + b],
                        factor, row + (k - k0));
            k = end;
        }
    }
}

static void mm_decode_panel(const mm_t *g, int64_t p0, int64_t rows, int64_t k0, int64_t kc,
                            uint16_t *wb) {
    mm_decode_panel_cols(g, p0, rows, k0, 0, kc, wb);
}

AI __m512 mm_round_bf16(__m512 v) { /* the bf16 value nearest v (RNE), as fp32; NaN kept */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

/* 16 tokens m0 .. m0 + 16 (mvalid of them real) x MM_MR rows n0 .. (nvalid real) from the
 * accumulators acc[r] (lanes: tokens): the epilogue, then a transpose into out's rows. */
static void mm_epilogue(const mm_t *g, const __m512 *acc, int64_t m0, int64_t mvalid,
                        int64_t n0, int64_t nvalid) {
    __mmask16 mm = mvalid >= 16 ? 0xffff : (__mmask16)((1u << mvalid) - 1u);
    __m512 am = _mm512_setzero_ps();
    if (g->as) am = g->as_n == 1 ? _mm512_set1_ps(g->as[0]) : _mm512_maskz_loadu_ps(mm, g->as + m0);
    __m512i r[16];
    __mmask16 bad = 0;
    for (int i = 0; i < 16; ++i) {
        if (i >= nvalid || i >= MM_MR) {
            r[i] = _mm512_setzero_si512();
            continue;
        }
        /* with scales after the matmul the emulation rounds the bf16 product first; without,
         * F.linear(a, w, bias) adds the bias to the fp32 sum and rounds once */
        __m512 v = (g->as || g->ps) ? mm_round_bf16(acc[i]) : acc[i];
        int64_t n = n0 + i;
        if (g->as || g->ps) {
            float wsn = g->ps ? g->ps[g->ps_n == 1 ? 0 : n] : 1.0f;
            __m512 sc = g->as ? (g->ps ? _mm512_mul_ps(am, _mm512_set1_ps(wsn)) : am)
                              : _mm512_set1_ps(wsn);
            v = _mm512_mul_ps(v, sc);
        }
        if (g->bias) v = _mm512_add_ps(v, _mm512_set1_ps(bf16_bits_to_f32(g->bias[n])));
        bad |= _mm512_mask_fpclass_ps_mask(mm, v, 0x99); /* NaN (quiet, signalling), +-inf */
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r[i] = _mm512_mask_mov_epi32(h, nan, _mm512_set1_epi32(0x7fc0));
    }
    if (bad) __atomic_fetch_or(g->err, 2, __ATOMIC_RELAXED);
    tr16x16(r); /* r[t]: token m0 + t, rows n0 .. n0 + 16 */
    __mmask16 nm = (__mmask16)((1u << (nvalid < MM_MR ? nvalid : MM_MR)) - 1u);
    for (int64_t t = 0; t < mvalid && t < 16; ++t)
        _mm256_mask_storeu_epi16(g->out + (m0 + t) * g->N + n0, nm, _mm512_cvtepi32_epi16(r[t]));
}

/* The next panel's decode, done inside the last token tile of the current one (unscaled
 * codes only): rows [0, rows) x codes [0, cols) of src (row stride ld) into the panel buffer,
 * 64 codes of every row after each 32 k-pairs of the tile, i.e. into columns the tile has
 * just read for the last time. The caller decodes the rest (mm_dec_done columns are done). */
typedef struct {
    const uint8_t *src;
    int64_t ld, rows, cols;
    int fmt;
} mm_dec_t;

AI int64_t mm_dec_done(const mm_dec_t *dec, int64_t pairs) {
    int64_t a = pairs / 32, b = dec->cols / 64;
    return 64 * (a < b ? a : b);
}

AI void mm_dec_cols(const mm_dec_t *dec, int64_t col, uint16_t *wb) {
    const __m512i hi0 = T_HI[dec->fmt][0], hi1 = T_HI[dec->fmt][1];
    const __m512i lo0 = T_LO[dec->fmt][0], lo1 = T_LO[dec->fmt][1];
    for (int64_t r = 0; r < dec->rows; ++r) {
        __m512i o0, o1;
        dec64_bf16(dec->src + r * dec->ld + col, hi0, hi1, lo0, lo1, PERM, &o0, &o1);
        _mm512_storeu_si512(wb + r * MM_WLD + col, o0);
        _mm512_storeu_si512(wb + r * MM_WLD + col + 32, o1);
    }
}

/* Pairs [j0, j1) of the next K block's activations of this token tile (NV vectors of 16
 * tokens), prefetched into the caches during the last panel of a K block, while this tile's
 * activations of the current block are read for the last time. Otherwise the first panel of
 * each K block of every row chunk but the first read them from L3 or memory (the other K
 * blocks passed through L2 meanwhile): up to twice as slow, ~2 % of all at K = 5632. */
AI void mm_prefetch_x(const uint32_t *nx, int64_t ldx, int64_t j0, int64_t j1, int nv) {
    for (int64_t j = j0; j < j1; ++j) {
        _mm_prefetch((const char *)(nx + j * ldx), _MM_HINT_T0);
        if (nv == 2) _mm_prefetch((const char *)(nx + j * ldx + 16), _MM_HINT_T0);
    }
}

/* The lines of out that the epilogue of tokens m0 .. m0 + tokens writes (columns n0 .. n0 +
 * MM_MR), prefetched for writing one 32-pair step before it: the activations streamed
 * through L1 meanwhile evict them, and each of the epilogue's 32 partial-line stores waited
 * for its line. */
AI void mm_prefetch_out(const mm_t *g, int64_t m0, int64_t tokens, int64_t n0) {
    for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t *o = g->out + (m0 + t) * g->N + n0;
        __builtin_prefetch(o, 1, 3);
        __builtin_prefetch(o + MM_MR - 1, 1, 3);
    }
}

/* MM_MR rows x NV * 16 tokens over `pairs` k-pairs. wb: the decoded panel; xt: the packed
 * activations of the first token (pair stride ldx); c: partial sums [row][token] (stride
 * ldc), unless first (start at 0) / last (the epilogue writes out instead); dec: NULL, or
 * the next panel to decode into wb as the tile goes (see mm_dec_t). */
#define DEFINE_MMK(NV, MR)                                                                    \
    static void mmk_##NV##_##MR(const mm_t *g, uint16_t *wb, const uint32_t *xt, int64_t ldx, \
                         int64_t pairs, float *c, int64_t ldc, int first, int last,           \
                         int64_t m0, int64_t mvalid, int64_t n0, int64_t nvalid,              \
                         const mm_dec_t *dec, const uint32_t *nx, int64_t npairs) {           \
        __m512 acc[NV][MR];                                                                \
        for (int r = 0; r < MR; ++r)                                                       \
            for (int v = 0; v < NV; ++v)                                                      \
                acc[v][r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * v); \
        int64_t dec_end = dec ? mm_dec_done(dec, pairs) : 0;                                  \
        for (int64_t j0 = 0; j0 < pairs; j0 += 32) {                                          \
            int64_t j1 = j0 + 32 < pairs ? j0 + 32 : pairs;                                   \
            if (nx) mm_prefetch_x(nx, ldx, j0, j1 < npairs ? j1 : npairs, NV);                 \
            for (int64_t j = j0; j < j1; ++j) {                                               \
                __m512bh x0 = (__m512bh)_mm512_loadu_si512(xt + j * ldx);                    \
                __m512bh x1 = x0;                                                             \
                if (NV == 2) x1 = (__m512bh)_mm512_loadu_si512(xt + j * ldx + 16);           \
                for (int r = 0; r < MR; ++r) {                                             \
                    int32_t pair;                                                             \
                    memcpy(&pair, wb + r * MM_WLD + 2 * j, 4);                                \
                    __m512bh b = (__m512bh)_mm512_set1_epi32(pair);                          \
                    acc[0][r] = _mm512_dpbf16_ps(acc[0][r], b, x0);                           \
                    if (NV == 2) acc[NV - 1][r] = _mm512_dpbf16_ps(acc[NV - 1][r], b, x1);    \
                }                                                                             \
            }                                                                                 \
            if (2 * j0 < dec_end) mm_dec_cols(dec, 2 * j0, wb);                               \
            if (last && j0 + 64 >= pairs && j0 + 32 < pairs) /* one step before the epilogue */ \
                mm_prefetch_out(g, m0, mvalid < 16 * NV ? mvalid : 16 * NV, n0);               \
        }                                                                                     \
        if (!last) {                                                                          \
            for (int r = 0; r < MR; ++r)                                                   \
                for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[v][r]); \
            return;                                                                           \
        }                                                                                     \
        for (int v = 0; v < NV; ++v)                                                          \
            mm_epilogue(g, acc[v], m0 + 16 * v, mvalid - 16 * v, n0, nvalid);                 \
    }
/* MR < MM_MR: the last panel of a weight with N % MM_MR rows (zero rows not multiplied) */
DEFINE_MMK(1, 14)
DEFINE_MMK(2, 14)
DEFINE_MMK(1, 8)
DEFINE_MMK(2, 8)
DEFINE_MMK(1, 4)
DEFINE_MMK(2, 4)

/* Per-thread scratch, grown on demand and kept between calls (freed when the thread ends):
 * a worker's decoded panel (28 KiB), partial sums (224 KiB) and, with more tokens than MM_MC,
 * its own packed activations (512 * K bytes); the calling thread's packed activations
 * shared by the workers (at most 512 * K bytes) and dynamic scales (4 * M bytes). A fresh
 * allocation per call costs page faults (about 3 MiB at K = 5632, every call). */
typedef struct {
    void *p;
    size_t cap;
} scratch_t;
static pthread_key_t MM_KEY[2];
static pthread_once_t MM_KEY_ONCE = PTHREAD_ONCE_INIT;
static int MM_KEY_OK = 0;

static void mm_scratch_free(void *p) {
    scratch_t *s = (scratch_t *)p;
    free(s->p);
    free(s);
}

static void mm_key_init(void) {
    MM_KEY_OK = pthread_key_create(&MM_KEY[0], mm_scratch_free) == 0 &&
                pthread_key_create(&MM_KEY[1], mm_scratch_free) == 0;
}

/* kind 0: a worker's own; kind 1: the calling thread's, for what the workers share */
static void *mm_scratch(int kind, size_t bytes) {
    pthread_once(&MM_KEY_ONCE, mm_key_init);
    if (!MM_KEY_OK) return NULL;
    scratch_t *s = (scratch_t *)pthread_getspecific(MM_KEY[kind]);
    if (s == NULL) {
        s = (scratch_t *)calloc(1, sizeof *s);
        if (s == NULL) return NULL;
        if (pthread_setspecific(MM_KEY[kind], s)) {
            free(s);
            return NULL;
        }
    }
    if (s->cap < bytes) {
        free(s->p);
        s->p = NULL;
        s->cap = 0;
        if (posix_memalign(&s->p, 64, bytes)) {
            s->p = NULL;
            return NULL;
        }
        s->cap = bytes;
    }
    return s->p;
}

/* No loop splitting: GCC would split the token-tile loop at its last tile (the one that
 * decodes ahead) into two copies of all six inlined micro-kernels: 10 KB of code and 0.15 s
 * of the build, at the same speed (measured at M = 256, both shapes). */
__attribute__((optimize("no-split-loops"))) static void *mm_worker(void *arg) {
    mm_t gl = *(const mm_t *)arg; /* its token block fields change below */
    const mm_t *g = &gl;
    int64_t r0 = g->n0 * MM_MR, r1 = g->n1 * MM_MR < g->N ? g->n1 * MM_MR : g->N;
    if (r0 >= r1) return NULL;
    if (gl.am) { /* dynamic: the scales first; per tensor then as with a given scale */
        mm_amax(g, gl.am);
        if (gl.am->gran == GRAN_ROW) {
            gl.as = gl.am->out, gl.as_n = g->M; /* the token scales, also the post scales */
        } else {
            gl.qs = tensor_scale(gl.am->out, g->M, g->qfmt, g->qfloor);
            gl.qscale = gl.as = &gl.qs;
            gl.as_n = 1;
        }
    }
    int64_t kblocks = (g->K + g->kc - 1) / g->kc;
    int multi = kblocks > 1;
    int64_t mcp_max = ((g->M < MM_MC ? g->M : MM_MC) + 15) & ~(int64_t)15;
    int64_t ldx = mcp_max, ldc = mcp_max;
    /* scratch of this thread, kept for its next call: a decoded panel (28 KiB), MM_MC x K
       bf16 activations, MM_NC x MM_MC fp32 partial sums when K > MM_KC */
    size_t n_wb = (size_t)MM_MR * MM_WLD * 2;
    mm_share_t *sh = g->sh;
    size_t n_xp = sh ? 0 : (size_t)kblocks * (g->kc / 2) * ldx * 4;
    size_t n_c = multi ? (size_t)MM_NC * ldc * 4 : 0;
    char *scratch = (char *)mm_scratch(0, n_wb + n_xp + n_c);
    if (scratch == NULL) {
        __atomic_fetch_or(g->err, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    uint16_t *wb = (uint16_t *)scratch;
    uint32_t *xp = sh ? sh->xp : (uint32_t *)(scratch + n_wb);
    float *c = multi ? (float *)(scratch + n_wb + n_xp) : NULL;
    int ahead = 0; /* 1: the previous panel's last tile already decoded this one into wb */
    for (int64_t mc0 = 0; mc0 < g->M; mc0 += MM_MC) {
        int64_t mc = g->M - mc0 < MM_MC ? g->M - mc0 : MM_MC, mcp = (mc + 15) & ~(int64_t)15;
        gl.mc0 = mc0, gl.mc = mc, gl.mcp = mcp, gl.ldx = ldx;
        /* several token blocks: each thread packs the activations it reads */
        if (!sh) mm_pack_x(g, xp);
        for (int64_t nc0 = r0; nc0 < r1; nc0 += MM_NC) {
            int64_t nc1 = nc0 + MM_NC < r1 ? nc0 + MM_NC : r1;
            for (int64_t k0 = 0, kb = 0; k0 < g->K; k0 += g->kc, ++kb) {
                int64_t kc = g->K - k0 < g->kc ? g->K - k0 : g->kc;
                int first = k0 == 0, last = k0 + kc == g->K;
                const uint32_t *xb = xp + kb * (g->kc / 2) * ldx;
                if (sh && nc0 == r0) mm_share_wait(g, sh, kb); /* packed on first use */
                for (int64_t p0 = nc0; p0 < nc1; p0 += MM_MR) {
                    int64_t rows = nc1 - p0 < MM_MR ? nc1 - p0 : MM_MR;
                    if (!ahead) mm_decode_panel(g, p0, rows, k0, kc, wb);
                    /* the next panel of this loop nest (none after the thread's last chunk:
                       qn = 0): rows q0 .. q0 + qn, codes qk .. qk + qkc */
                    int64_t q0 = p0 + MM_MR < nc1 ? p0 + MM_MR : k0 + kc < g->K ? nc0 : nc1;
                    int64_t qk = p0 + MM_MR < nc1 ? k0 : k0 + kc < g->K ? k0 + kc : 0;
                    int64_t qn = q0 + MM_MR < r1 ? MM_MR : r1 - q0;
                    int64_t qkc = g->K - qk < g->kc ? g->K - qk : g->kc;
                    /* unscaled codes: the last token tile decodes the next panel as it goes */
                    int fuse = g->ws == NULL && qn > 0;
                    mm_dec_t dec = {g->w + q0 * g->K + qk, g->K, qn, qkc, g->fmt};
                    int64_t tiles = (mcp + MM_TT - 1) / MM_TT;
                    /* the last panel of a K block: the activations of the next block (or
                       of the first, for the next chunk) */
                    const uint32_t *nx = NULL;
                    int64_t npairs = 0;
                    if (p0 + MM_MR >= nc1 && kblocks > 1 && (k0 + kc < g->K || nc1 < r1)) {
                        int64_t nb = k0 + kc < g->K ? kb + 1 : 0, nk0 = nb * g->kc;
                        nx = xp + nb * (g->kc / 2) * ldx;
                        npairs = (g->K - nk0 < g->kc ? g->K - nk0 : g->kc) / 2;
                    }
                    for (int64_t t = 0; t < tiles; ++t) {
                        int64_t t0 = t * MM_TT;
                        float *ct = c ? c + (p0 - nc0) * ldc + t0 : NULL;
                        const mm_dec_t *dt = fuse && t == tiles - 1 ? &dec : NULL;
                        /* the next panel's codes, a piece before each token tile but the
                           last: short row pieces that the hardware prefetcher does not
                           pick up */
                        int64_t pt = tiles > 1 ? tiles - 1 : 1;
                        for (int64_t r = qn * t / pt; t < pt && r < qn * (t + 1) / pt; ++r)
                            for (int64_t k = 0; k < qkc; k += 64)
                                _mm_prefetch((const char *)(g->w + (q0 + r) * g->K + qk + k),
                                             _MM_HINT_T0);
#define MM_CALL(NV, MR)                                                                   \
    mmk_##NV##_##MR(g, wb, xb + t0, ldx, kc / 2, ct, ldc, first, last, mc0 + t0, mc - t0, p0, \
                    rows, dt, nx ? nx + t0 : NULL, npairs)
                        int two = mcp - t0 >= MM_TT;
                        if (rows > 8) {
                            if (two) MM_CALL(2, 14);
                            else MM_CALL(1, 14);
                        } else if (rows > 4) {
                            if (two) MM_CALL(2, 8);
                            else MM_CALL(1, 8);
                        } else {
                            if (two) MM_CALL(2, 4);
                            else MM_CALL(1, 4);
                        }
#undef MM_CALL
                    }
                    if (fuse) { /* the columns the last tile did not decode, zero rows */
                        int64_t done = mm_dec_done(&dec, kc / 2);
                        if (done < qkc || qn < MM_MR) /* (usually nothing is left) */
                            mm_decode_panel_cols(g, q0, qn, qk, done, qkc, wb);
                    }
                    ahead = fuse;
                }
            }
        }
    }
    return NULL;
}

static void mm_range(void *p, int64_t n0, int64_t n1) {
    ((mm_t *)p)->n0 = n0;
    ((mm_t *)p)->n1 = n1;
}
#endif

#if IN_PART(1)
/* out [M, N] bf16 = epilogue(bf16(x @ decode(w).T)): see above. ws: folded into the decode
 * (NULL: unscaled codes); as / ps: post scales. qfmt >= 0: x is first fake-quantized to
 * that format inside the kernel (no second parallel region, no [M, K] temporary), the
 * activation scales then being the post scales: with as = NULL dynamically, per token
 * (qgran row) or per tensor (qgran tensor), exactly as fp8_quant_act(qgran, post, bf16 out,
 * floor qfloor) does; with a given scale as ([1], static, qgran tensor) exactly as
 * fp8_quant_act(gran tensor, given, post, bf16 out). Returns -3 where the path lacks the
 * kernel. */
int fp8_mm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                const float *ws, int64_t wgran, int64_t bn, int64_t bk, const float *as,
                int64_t as_n, const float *ps, int64_t ps_n, const uint16_t *bias,
                uint16_t *out, int64_t fmt, int64_t nthreads, int64_t qfmt, float qfloor,
                int64_t qgran) {
#if FP8_PATH == 4
    if (M < 1 || K < 2 || (K & 1) || N < 1 || bn < 1 || bk < 1 || (fmt != 0 && fmt != 1) ||
        (as && as_n != 1 && as_n != M) || (ps && ps_n != 1 && ps_n != N) || qfmt < -1 ||
        qfmt > 1 || (qfmt >= 0 && qgran != GRAN_TENSOR && qgran != GRAN_ROW) ||
        (qfmt >= 0 && as && (as_n != 1 || qgran != GRAN_TENSOR)))
        return -1;
    pthread_once(&LUT_ONCE, lut_init);
    int err = 0;
    /* K blocks of at most MM_KC codes, a multiple of 64 (the decode-ahead then covers whole
       blocks; the block sizes do not change the summation order, so neither the bits) */
    int64_t blocks = (K + MM_KC - 1) / MM_KC, kc = ((K + blocks - 1) / blocks + 63) & ~(int64_t)63;
    blocks = (K + kc - 1) / kc;
    mm_t g = {x, w, ws, as, ps, bias, out, &err, M, K, N, bn, bk, 0, 0, as_n, ps_n, kc,
              0, 0, 0, 0, (int)fmt, (int)wgran, (int)qfmt, qfmt >= 0 ? as : NULL, qfloor,
              0.0f, NULL, NULL};
    mm_share_t sh = {NULL, NULL, 0, 0, 0};
    mm_amax_t am = {NULL, 0, 0, (M + 15) / 16, (int)qgran};
    int shared = M <= MM_MC, dynamic = qfmt >= 0 && !as;
    int64_t mcp = (M + 15) & ~(int64_t)15;
    /* the calling thread's: packed activations (one token block), dynamic scales, counters */
    size_t n_xp = shared ? (size_t)blocks * (kc / 2) * mcp * 4 : 0;
    size_t n_sc = dynamic ? ((size_t)M * 4 + 63) & ~(size_t)63 : 0;
    if (shared || dynamic) {
        char *s = (char *)mm_scratch(1, n_xp + n_sc + (size_t)blocks * 8);
        if (s == NULL) return -4;
        if (dynamic) {
            am.out = (float *)(s + n_xp);
            g.am = &am;
        }
        if (shared) {
            sh.xp = (uint32_t *)s;
            sh.done = (int64_t *)(s + n_xp + n_sc);
            memset(sh.done, 0, (size_t)blocks * 8);
            sh.groups = mcp / 16;
            sh.units = blocks * sh.groups;
            g.sh = &sh;
        }
    }
    int64_t panels = (N + MM_MR - 1) / MM_MR;
    int64_t useful = (M * N * K) / (1 << 22);
    if (nthreads > useful) nthreads = useful < 1 ? 1 : useful;
    int rc = run_split(mm_worker, &g, sizeof g, panels, nthreads, mm_range);
    return rc ? rc : (err & 1) ? -4 : (err & 2) ? 1 : 0; /* 1: some output is +-inf or NaN */
#else
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)ws, (void)wgran, (void)bn, (void)bk;
    (void)as, (void)as_n, (void)ps, (void)ps_n, (void)bias, (void)out, (void)fmt, (void)nthreads;
    (void)qfmt, (void)qfloor, (void)qgran;
    return -3;
#endif
}
#endif

#if IN_PART(2)
/* The path this library was built for (checked by the loader). */
int fp8_kernel_path(void) { return FP8_PATH; }

/* 1 when this CPU runs every instruction the path uses (checked before the first call). */
int fp8_cpu_ok(void) {
#if FP8_PATH >= 3
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("avx512dq") &&
           (FP8_PATH == 3 || (__builtin_cpu_supports("avx512vbmi") &&
                              __builtin_cpu_supports("avx512bf16")));
#elif FP8_PATH == 2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
#else
    return 1;
#endif
}
#endif
