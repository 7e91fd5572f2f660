/* Fused CPU step of hf_fp8.optim.AdamWFp8 (see hf_fp8/optim/_cpu_kernel.py).

   Every arithmetic line mirrors hf_fp8.numerics.coat / hf_fp8.numerics.log_moments and
   hf_fp8.optim._step.grouped_step / grouped_step_log in the same order, so results are
   bit-identical to the reference. Two families of variants: the fp8 codes (run_groups) and
   moment_format="log" (run_groups_log: no polynomial at all, ~2.6x faster). Loops are
   branch-free so that the compiler vectorizes them; max/min reductions run on the bit patterns
   of non-negative floats. With AVX-512 F + DQ (groups whose length is a multiple of 16),
   hand-written loops compute the same values: E4M3 codes with COAT expansion decode as
   ±A[E]·B[j] from per-group tables (coat.dequantize_groups) in registers of the update loop
   (update_group_ex_v; with VBMI dec_coat_vb: the B index from a 128-entry byte table, one byte
   permute, two float permutes and one multiplication per 16 codes; without, dec_coat_v: three
   permutes and one masked multiplication), the B tables from a per-thread cache keyed by k
   (b_table16), and requantize with the polynomial chains of 8 vectors interleaved
   (requant_e4m3_ex_v), where single AVX-512 instructions (vgetexpps, vscalefps, vrangeps,
   vfpclassps, masked min, conversions with embedded rounding) replace the scalar code's bit
   manipulations with the same results (checked exhaustively: see requant_e4m3_ex_v), the
   casts are e4m3_code_rn_v / e4m3_code_sr_v (checked on every magnitude) and, with VBMI, 64
   codes are packed at a time with byte permutes; the next chunk's memory is prefetched while
   a chunk requantizes (prefetch_group); the log format has its three loops
   (update_group_log_v, requant_log_v_v, requant_log_m_v). With AVX2 and no AVX-512 (Zen 1-3,
   Intel clients), the default variant has 8-lane loops (update_group_ex_v8: m's and v's codes
   decoded together from byte planes with vpshufb, 4 vectors updated at a time;
   requant_e4m3_ex_v8: 8 vectors interleaved; dequant_a_v8: the A tables; b_planes: a
   per-thread cache of the B tables by k). Threads take groups from a shared counter; built
   with -fopenmp (USE_OMP) they are torch's own OpenMP pool.

   Built by hf_fp8.utils.native.load_library with -D defines generated from ONE Python table
   (hf_fp8/optim/_cpu_kernel.py: kernel_defines()): the task layout T_* / T_FIELDS, the
   hyper-parameter slots HP_* / HP_FIELDS, the variant flag bits FLAG_*, the VARIANT of this
   library and coat's constants (LOG2_C*, EXP2_C*, fp8 maxima, exponent steps). This file
   restates none of them; a missing define is a compile error. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#if defined(USE_OMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HAVE_DEC_AVX512 1
#else
#define HAVE_DEC_AVX512 0
#endif
/* AVX-512 VBMI (two-table byte permutes; Ice Lake, Zen 4 and later): the requantization
   packs 64 codes at a time (requant_e4m3_ex_v) */
#if HAVE_DEC_AVX512 && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define HAVE_VBMI 1
#else
#define HAVE_VBMI 0
#endif
/* AVX2 without AVX-512 (e.g. Zen 1-3, Haswell-Skylake clients): 8-lane loops for the default
   variant (E4M3 codes with expansion); see update_group_ex_v8 / requant_e4m3_ex_v8. */
#if !HAVE_DEC_AVX512 && defined(__AVX2__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#else
#define HAVE_AVX2_PATH 0
#endif

#define AI static inline __attribute__((always_inline))
#define FLT_MIN_F 1.17549435082228750797e-38f
#define FLT_MIN_BITS 0x00800000u
#define FLT_MAX_BITS 0x7F7FFFFFu
#define INF_BITS 0x7F800000u
#define MAGIC 12582912.0f /* 1.5 * 2^23: x + MAGIC - MAGIC rounds x to an integer */
#define MAGIC_BITS 0x4B400000u
#define MAX_THREADS 64

#if !defined(T_FIELDS) || !defined(HP_FIELDS) || !defined(VARIANT) || !defined(FLAG_EXPAND)
#error "build through hf_fp8.optim._cpu_kernel: the layout comes from its Python table"
#endif
#if LOG2_NCOEFFS != 6 || EXP2_NCOEFFS != 4
#error "the Horner chains below are written for 6 log2 and 4 exp2 coefficients"
#endif


AI float b2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
AI uint32_t f2b(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* All ones for the bit pattern a (sign cleared) of a number, 0 for NaN: `a & not_nan(a)` leaves
   NaN out of a max reduction (written as a mask, not a select: the loops still vectorize). */
AI uint32_t not_nan(uint32_t a) { return 0u - (uint32_t)(a <= INF_BITS); }

AI float flog2(float x) {
    uint32_t b = f2b(x);
    float e = (float)((int32_t)(b >> 23) - 127);
    float t = b2f((b & 0x7FFFFFu) | 0x3F800000u) - 1.0f;
    float acc = t * LOG2_C5 + LOG2_C4;
    acc = acc * t + LOG2_C3;
    acc = acc * t + LOG2_C2;
    acc = acc * t + LOG2_C1;
    acc = acc * t + LOG2_C0;
    return e + acc * t;
}

/* 2^y for y >= -126 (callers clamp, or know the bound: see requant). */
AI float fexp2_nc(float y) {
    float r = floorf(y); /* one vrndscaleps; coat.fast_exp2's torch.floor */
    float f = y - r;
    uint32_t n = (uint32_t)(int32_t)r;
    float acc = f * EXP2_C3 + EXP2_C2;
    acc = acc * f + EXP2_C1;
    acc = acc * f + EXP2_C0;
    float poly = acc * f + 1.0f;
    return b2f(f2b(poly) + (n << 23));
}

AI float fexp2(float y) { return fexp2_nc((y < -126.0f) ? -126.0f : y); }

AI float dec_fp8(uint8_t c, const int E5) {
    uint32_t s = ((uint32_t)(c & 0x80u)) << 24;
    float mag;
    if (E5) {
        uint32_t e = (c >> 2) & 31u, m = c & 3u;
        float sub = (float)m * 1.52587890625e-05f;
        float nor = b2f(((e + 112u) << 23) | (m << 21));
        mag = (e == 0u) ? sub : nor;
        mag = (e == 31u) ? b2f(INF_BITS | (m << 21)) : mag;
    } else {
        uint32_t e = (c >> 3) & 15u, m = c & 7u;
        float sub = (float)m * 0.001953125f;
        float nor = b2f(((e + 120u) << 23) | (m << 20));
        mag = (e == 0u) ? sub : nor;
        mag = ((c & 0x7Fu) == 0x7Fu) ? b2f(0x7FC00000u) : mag;
    }
    return b2f(f2b(mag) | s);
}

/* Round-to-nearest-even cast of a float (|x| <= fp8 max, or NaN) to fp8 bits. */
AI uint8_t enc_fp8(float x, const int E5) {
    uint32_t b = f2b(x);
    uint32_t s = (b >> 24) & 0x80u;
    uint32_t ab = b & 0x7FFFFFFFu;
    float a = b2f(ab);
    uint32_t c;
    if (E5) {
        uint32_t cn = ((ab + 0xFFFFFu + ((ab >> 21) & 1u)) >> 21) - (112u << 2);
        uint32_t cs = f2b(a * 65536.0f + MAGIC) - MAGIC_BITS;
        c = (a < 6.103515625e-05f) ? cs : cn;
    } else {
        uint32_t cn = ((ab + 0x7FFFFu + ((ab >> 20) & 1u)) >> 20) - (120u << 3);
        uint32_t cs = f2b(a * 512.0f + MAGIC) - MAGIC_BITS;
        c = (a < 0.015625f) ? cs : cn;
    }
    c = (ab > INF_BITS) ? 0x7Fu : c;
    return (uint8_t)(c | s);
}

/* coat.decode_log2_tables: ea[E] (log2 of F's mantissa field in exponent field E) and db[i]
   (the offset of mantissa j from it: i = j normal, i = 2^mb + j subnormal), the same fp32
   operations. */
AI void decode_log2_tables(float* restrict ea, float* restrict db, const int E5) {
    const int mb = E5 ? 2 : 3, bias = E5 ? 15 : 7, nj = 1 << mb, top = E5 ? 3 : 6;
    float ln[8], ls[8];
    for (int j = 0; j < nj; ++j) {
        ln[j] = flog2((float)j * (1.0f / (float)nj) + 1.0f);
        ls[j] = flog2((j > 0) ? (float)j : 1.0f);
    }
    for (int e = 0; e < (1 << (7 - mb)); ++e)
        ea[e] = (e > 0) ? ((float)e - (float)bias) + ln[top]
                        : (float)(1 - bias - mb) + ls[nj - 1];
    for (int j = 0; j < nj; ++j) {
        db[j] = ln[j] - ln[top];
        db[nj + j] = ls[j] - ls[nj - 1];
    }
}

#if HAVE_DEC_AVX512
/* floorf / rintf of 16 lanes */
#define FLOOR_V(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define RINT_V(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* fexp2_nc / fexp2 on 16 lanes, the same values: vscalefps gives poly·2^floor(y), the
   bit-pattern add (exact: y >= -126 gives a normal result). */
AI __m512 fexp2_v(__m512 y, const int CLAMP) {
    /* (y < -126) ? -126 : y, written max(-126, y): a NaN y stays NaN */
    if (CLAMP) y = _mm512_max_ps(_mm512_set1_ps(-126.0f), y);
    __m512 f = _mm512_sub_ps(y, FLOOR_V(y));
    __m512 acc = _mm512_add_ps(_mm512_mul_ps(f, _mm512_set1_ps(EXP2_C3)), _mm512_set1_ps(EXP2_C2));
    acc = _mm512_add_ps(_mm512_mul_ps(acc, f), _mm512_set1_ps(EXP2_C1));
    acc = _mm512_add_ps(_mm512_mul_ps(acc, f), _mm512_set1_ps(EXP2_C0));
    __m512 poly = _mm512_add_ps(_mm512_mul_ps(acc, f), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(poly, y);
}

/* A group's decode tables in registers for dec_coat_v: A[E] and -A[E] (a 32-entry table
   indexed by sign and exponent field: code >> 3), B[j] of the normal codes and B[8 + j] of
   the subnormal ones, each repeated in both halves (indexed by the code's low 4 bits), the
   zero code's entry 0. */
typedef struct {
    __m512 a, na, bn, bs;
} dec_tab_t;

AI dec_tab_t dec_tables_v(const float* ta, const float* tb) {
    dec_tab_t t;
    __m512 b = _mm512_loadu_ps(tb);
    t.a = _mm512_loadu_ps(ta);
    t.na = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(t.a), _mm512_set1_epi32((int)0x80000000u)));
    t.bn = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7), b);
    t.bs = _mm512_maskz_permutexvar_ps(
        0xFEFE, _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15), b);
    return t;
}

/* Decode 16 E4M3 codes with COAT expansion (update_group's EX branch, bit for bit):
   ±A[E] · B[j (+8 for a subnormal code)] from the group's tables (dec_tables_v), three
   permutes. The sign comes from the table (±A: IEEE multiplication is symmetric in sign),
   the zero codes ±0x00 decode to ±A[0]·0 = ±0 (the reference's copysign(0, ±0)) and the NaN
   codes 0x7F / 0xFF to +0 (the reference: ±0; a zero moment's sign changes no result:
   m' = m + w1·(g - m) and v' = v·β2 + w2·g² are +0 or the same value for m, v = ±0). */
AI __m512 dec_coat_v(const uint8_t* q, dec_tab_t t) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    __m512 a = _mm512_permutex2var_ps(t.a, _mm512_srli_epi32(c, 3), t.na);
    __mmask16 sub = _mm512_testn_epi32_mask(c, _mm512_set1_epi32(0x78)); /* exponent field 0 */
    __m512 b = _mm512_permutexvar_ps(c, t.bn);
    b = _mm512_mask_permutexvar_ps(b, sub, c, t.bs);
    __mmask16 ok = _mm512_cmpneq_epi32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)),
                                            _mm512_set1_epi32(0x7F));
    return _mm512_maskz_mul_ps(ok, a, b);
}

AI __m512 bf16x16_to_f(const uint16_t* h) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)h));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

AI void f_to_bf16x16(uint16_t* out, __m512 f) { /* f_to_bf16 on 16 lanes */
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32((int)INF_BITS));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i*)out, _mm512_cvtepi32_epi16(r));
}

#endif

#if HAVE_DEC_AVX512
/* requant's EX branch for E4M3 codes, U vectors of 16 lanes at a time (n a multiple of 16·U):
   the same values as the scalar loop (flog2, fexp2_nc, the clamp to F, then enc_fp8_mag or
   sr_code) per element. Each step is applied to the U (<= 8) vectors before the next step:
   the polynomial chains of U vectors are interleaved, so that the loop is not bound by the
   latency of one chain (U = 8, a whole 128-element group: 63 -> 40 ns per group
   round-to-nearest, 68 -> 52 ns stochastic, against the autovectorized scalar loop).
   AVX-512 instructions that give the scalar loop's exact values in one operation instead of
   its two or three (the polynomials and every rounded operation are unchanged):
   - vrangeps min(|x|, FLT_MAX), sign cleared: |x| with inf as FLT_MAX, whose flog2 is the
     same 128.0 (the one lane it changes; the test test_kernel_requant_exact checks it);
   - vgetexpps: the unbiased exponent (bits >> 23) - 127 as a float (exact for normal |x|;
     the other lanes are zeroed by nz);
   - vscalefps: poly · 2^floor(y), the bit-pattern add of fexp2_nc (exact: normal results);
   - vreduceps (round down, 0 fraction bits): y - floor(y). It rounds an inexact difference
     toward -inf where the scalar code rounds to nearest, but here the difference is exact:
     y = (lx - lmax)·k + log2 F is a sum with log2 F (8.8, spacing 2^-20), so a y in (-1, 0)
     is a multiple of 2^-20 and y + 1 is exact (y >= 0 or y <= -1: always exact). (Not so
     for the decode tables, whose y = db·(1/k) has any low bits: fexp2_v floors and
     subtracts.);
   - a zero-masked vminps: nz ? min(mag, F) : 0 in one instruction;
   - vcvtps2dq with embedded rounding: rint / floor then the integer conversion (exact: the
     values are integers below 2^24 once rounded);
   - the SR normal code (mag + low) >> 20 without clearing the low bits first (the shift drops
     them). */
#define RANGE_MIN_ABS 0x0A /* vrangeps: the smaller magnitude, sign bit cleared */
#define FPCLASS_NOT_NZ 0xA7 /* vfpclassps: QNaN, +0, -0, subnormal, SNaN */
#define REDUCE_FLOOR (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC) /* vreduceps: y - floor(y) */

/* enc_fp8_mag (E4M3) of 16 magnitudes in [0, F]: the normal code from the bit pattern, rounded
   to nearest even, or rint(mag·512) below 2^-6 (the MAGIC add) */
AI __m512i e4m3_code_rn_v(__m512 mag) {
    const __m512i mb = _mm512_castps_si512(mag);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(mb, 20), _mm512_set1_epi32(1));
    /* ((mb + 0x7FFFF + lsb) >> 20) - (120 << 3) with the subtraction moved before the shift
       (as 120 << 23): the same for the normal magnitudes this code is kept for (mb >= 2^-6's
       bits 0x3C800000: no wrap-around) */
    __m512i cn = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(mb, _mm512_set1_epi32((int)(0x7FFFFu - (120u << 23)))),
                         lsb),
        20);
    __mmask16 sub = _mm512_cmp_ps_mask(mag, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    /* sub ? rint(mag·512) : cn */
    return _mm512_mask_cvt_roundps_epi32(cn, sub, _mm512_mul_ps(mag, _mm512_set1_ps(512.0f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* sr_code (E4M3, sign 0) of 16 magnitudes in [0, F] with the random bits' top E4M3_SR_DROP bits
   low: the normal code (mag + low) >> 20 without clearing the low bits first (the shift drops
   them), or floor(mag·steps + u) below the smallest normal; without sr_code's clamp to F's
   code 0x7E, a no-op here: F = 448 has bits 0x43E00000, whose 20 low bits are 0 (+ low < 2^20
   carries no further), and a subnormal mag·steps + u < 8 + 1; no NaN magnitude */
AI __m512i e4m3_code_sr_v(__m512 mag, __m512i low) {
    const __m512i mb = _mm512_castps_si512(mag);
    __m512i cn = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(mb, low), E4M3_SR_DROP),
                                  _mm512_set1_epi32(120 << 3));
    __m512 uu = _mm512_mul_ps(_mm512_cvtepi32_ps(low), _mm512_set1_ps(E4M3_SR_UNIT));
    __mmask16 sub = _mm512_cmp_ps_mask(mag, _mm512_set1_ps(E4M3_SR_MIN_NORMAL), _CMP_LT_OQ);
    /* sub ? (int)floor(mag·steps + u) : cn, the multiply-add fused: the same rounded sum, the
       product by steps = 2^9 being exact (mag is 0 or a normal float <= F) */
    return _mm512_mask_cvt_roundps_epi32(
        cn, sub, _mm512_fmadd_ps(mag, _mm512_set1_ps(E4M3_SR_STEPS), uu),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
AI void requant_e4m3_ex_v(const float* restrict buf, uint8_t* restrict q, int64_t n, int64_t gs,
                          float k, float lmax, uint32_t key, const int SR, const int U) {
    const __m512 kv = _mm512_set1_ps(k), lm = _mm512_set1_ps(lmax);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* (key + i)·SR_WEYL of the 16 lanes, advanced by 16·SR_WEYL per vector */
    const __m512i dh = _mm512_set1_epi32((int)(16u * (uint32_t)SR_WEYL));
    __m512i h = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)key), lanes),
                                   _mm512_set1_epi32((int)(uint32_t)SR_WEYL));
#if HAVE_VBMI
    /* byte i < 32 of a two-table byte permute: byte 0 of dword i of the first table (i < 16)
       or of dword i - 16 of the second; the upper 32 bytes repeat them (unused) */
    const __m512i pick = _mm512_set_epi8(
        124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64, 60, 56, 52, 48,
        44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0, 124, 120, 116, 112, 108, 104, 100, 96, 92,
        88, 84, 80, 76, 72, 68, 64, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
#endif
    for (int64_t i0 = 0; i0 < n; i0 += 16 * U) {
        __m512i xb[8], c[8]; /* U <= 8 */
        __m512 ax[8], tm[8], acc[8], y[8], f[8], mag[8];
        __mmask16 nz[8];
        for (int u = 0; u < U; ++u) {
            __m512 x = _mm512_loadu_ps(buf + i0 + 16 * u);
            xb[u] = _mm512_castps_si512(x);
            /* |x|, inf as FLT_MAX (flog2 128.0 either way; a NaN lane gets FLT_MAX, zeroed
               by nz like the zero and subnormal lanes) */
            ax[u] = _mm512_range_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32((int)FLT_MAX_BITS)),
                                    RANGE_MIN_ABS);
            /* |x| >= FLT_MIN: not NaN, zero or subnormal (vfpclassps) */
            nz[u] = (__mmask16)~_mm512_fpclass_ps_mask(x, FPCLASS_NOT_NZ);
        }
        /* flog2 (of the magnitude itself, not of (nz ? |x| : 1): the lanes it differs in are
           zeroed below, whatever their log2) */
        for (int u = 0; u < U; ++u) {
            __m512i m = _mm512_ternarylogic_epi32(_mm512_castps_si512(ax[u]),
                                                  _mm512_set1_epi32(0x7FFFFF),
                                                  _mm512_set1_epi32(0x3F800000), 0xEA);
            tm[u] = _mm512_sub_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(1.0f));
        }
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_add_ps(_mm512_mul_ps(tm[u], _mm512_set1_ps(LOG2_C5)), _mm512_set1_ps(LOG2_C4));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_add_ps(_mm512_mul_ps(acc[u], tm[u]), _mm512_set1_ps(LOG2_C3));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_add_ps(_mm512_mul_ps(acc[u], tm[u]), _mm512_set1_ps(LOG2_C2));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_add_ps(_mm512_mul_ps(acc[u], tm[u]), _mm512_set1_ps(LOG2_C1));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_add_ps(_mm512_mul_ps(acc[u], tm[u]), _mm512_set1_ps(LOG2_C0));
        for (int u = 0; u < U; ++u) {
            __m512 lx = _mm512_add_ps(_mm512_getexp_ps(ax[u]), _mm512_mul_ps(acc[u], tm[u]));
            y[u] = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(lx, lm), kv),
                                 _mm512_set1_ps(E4M3_LOG2MAX));
        }
        /* fexp2_nc */
        for (int u = 0; u < U; ++u) {
            f[u] = _mm512_reduce_ps(y[u], REDUCE_FLOOR); /* y - floor(y): exact here */
            acc[u] = _mm512_add_ps(_mm512_mul_ps(f[u], _mm512_set1_ps(EXP2_C3)), _mm512_set1_ps(EXP2_C2));
        }
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_add_ps(_mm512_mul_ps(acc[u], f[u]), _mm512_set1_ps(EXP2_C1));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_add_ps(_mm512_mul_ps(acc[u], f[u]), _mm512_set1_ps(EXP2_C0));
        for (int u = 0; u < U; ++u) {
            __m512 poly = _mm512_add_ps(_mm512_mul_ps(acc[u], f[u]), _mm512_set1_ps(1.0f));
            /* nz ? min(poly·2^floor(y), F) : 0 */
            mag[u] = _mm512_maskz_min_ps(nz[u], _mm512_scalef_ps(poly, y[u]),
                                         _mm512_set1_ps(E4M3_MAX));
#ifdef REQUANT_PROBE_V /* tests only: the magnitude before the cast (test_kernel_requant_exact) */
            REQUANT_PROBE_V(i0 + 16 * u, mag[u]);
#endif
        }
        if (SR) {
            for (int u = 0; u < U; ++u) {
                c[u] = e4m3_code_sr_v(mag[u], _mm512_srli_epi32(h, 32 - E4M3_SR_DROP));
                h = _mm512_add_epi32(h, dh);
            }
        } else {
            for (int u = 0; u < U; ++u) c[u] = e4m3_code_rn_v(mag[u]);
        }
#if HAVE_VBMI
        if (U % 4 == 0) {
            /* 64 codes at a time: byte 0 of the code dwords and byte 3 of x's (its sign bit
               is bit 7 there) gathered in order with two-table byte permutes, then
               (sign & 0x80) | code: 8 instructions per 64 codes instead of 4 shifts, 4 ternary
               logic ops and 4 dword-to-byte narrowings */
            const __m512i b0 = pick;                                        /* byte 0 */
            const __m512i b3 = _mm512_add_epi8(pick, _mm512_set1_epi8(3)); /* byte 3 */
            for (int u = 0; u < U; u += 4) {
                __m512i cl = _mm512_permutex2var_epi8(c[u], b0, c[u + 1]);
                __m512i ch = _mm512_permutex2var_epi8(c[u + 2], b0, c[u + 3]);
                __m512i sl = _mm512_permutex2var_epi8(xb[u], b3, xb[u + 1]);
                __m512i sh = _mm512_permutex2var_epi8(xb[u + 2], b3, xb[u + 3]);
                __m512i code = _mm512_inserti64x4(cl, _mm512_castsi512_si256(ch), 1);
                __m512i sign = _mm512_inserti64x4(sl, _mm512_castsi512_si256(sh), 1);
                code = _mm512_ternarylogic_epi32(sign, _mm512_set1_epi8((char)0x80), code, 0xEA);
                _mm512_storeu_si512((void*)(q + i0 + 16 * u), code);
            }
            continue;
        }
#endif
        for (int u = 0; u < U; ++u) { /* | the sign bit (bit 31 of x moved to bit 7) */
            __m512i code = _mm512_ternarylogic_epi32(_mm512_srli_epi32(xb[u], 24),
                                                     _mm512_set1_epi32(0x80), c[u], 0xEA);
            _mm_storeu_si128((__m128i*)(q + i0 + 16 * u), _mm512_cvtepi32_epi8(code));
        }
    }
    for (int64_t i = n; i < gs; ++i) q[i] = 0;
}
#endif

#if HAVE_AVX2_PATH
/* ------------------------------------------------------------------ AVX2, 8 lanes
   The default variant (E4M3 codes with COAT expansion) on AVX2 machines without AVX-512:
   without these loops the update loop stays scalar (its table decode needs a gather, which
   the compiler does not choose) and the requantization runs in 4-lane vectors. Every fp32
   operation is the scalar loop's, in the same order; the decode reads the per-group tables
   from byte planes with vpshufb (dec_coat_mv16) or with vpermps (dec_coat_v8), as dec_coat does
   with loads. */
#define I8(x) _mm256_set1_epi32((int)(x))
#define F8(x) _mm256_set1_ps(x)

typedef struct {
    __m256 alo, ahi, bn, bs; /* A[0:8], A[8:16], B[0:8] (normal codes), B[8:16] (subnormal) */
} dec_tab8_t;

AI dec_tab8_t dec_tables_v8(const float* ta, const float* tb) {
    dec_tab8_t t;
    t.alo = _mm256_loadu_ps(ta);
    t.ahi = _mm256_loadu_ps(ta + 8);
    t.bn = _mm256_loadu_ps(tb);
    t.bs = _mm256_loadu_ps(tb + 8);
    return t;
}

/* dec_coat of 8 E4M3 codes: (ok ? A[E]·B[i] : 0) | sign, i = j (+8 for exponent field 0),
   ok: neither a zero code nor a NaN code (0x7F, 0xFF). */
AI __m256 dec_coat_v8(const uint8_t* q, dec_tab8_t t) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
    const __m256i e = _mm256_srli_epi32(c, 3); /* vpermps reads its low 3 bits */
    /* exponent field >= 8 (bit 6 of the code, moved to the sign bit): the upper half of A */
    __m256 a = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.alo, e),
                                _mm256_permutevar8x32_ps(t.ahi, e),
                                _mm256_castsi256_ps(_mm256_slli_epi32(c, 25)));
    const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(c, I8(0x78)), _mm256_setzero_si256());
    __m256 b = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.bn, c), _mm256_permutevar8x32_ps(t.bs, c),
                                _mm256_castsi256_ps(sub));
    const __m256i a7 = _mm256_and_si256(c, I8(0x7F));
    const __m256i bad = _mm256_or_si256(_mm256_cmpeq_epi32(a7, _mm256_setzero_si256()),
                                        _mm256_cmpeq_epi32(a7, I8(0x7F)));
    __m256i r = _mm256_andnot_si256(bad, _mm256_castps_si256(_mm256_mul_ps(a, b)));
    r = _mm256_or_si256(r, _mm256_slli_epi32(_mm256_and_si256(c, I8(0x80)), 24));
    return _mm256_castsi256_ps(r);
}

AI __m256 bf16x8_to_f(const uint16_t* h) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)h));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

AI void f_to_bf16x8(uint16_t* out, __m256 f) { /* f_to_bf16 on 8 lanes */
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), I8(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, I8(0x7FFF)), lsb), 16);
    /* |u| > INF_BITS: a signed compare is right, both sides are non-negative */
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, I8(0x7FFFFFFF)), I8(INF_BITS));
    r = _mm256_blendv_epi8(r, I8(0x7FC0), nan);
    _mm_storeu_si128((__m128i*)out, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                       _mm256_extracti128_si256(r, 1)));
}

AI uint32_t hmax_epu32_8(__m256i x) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

AI uint32_t hmin_epu32_8(__m256i x) {
    __m128i m = _mm_min_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_min_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_min_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* The byte planes of a 16-entry float table: plane k holds byte k of every entry, so that
   vpshufb (in-lane, one cheap instruction) reads byte k of the entries of 16 indices at once.
   Zen 1's vpermps (cross-lane) is slow: this decode of 16 codes with 8 vpshufb and 4 unpacks
   took about half the time of 8 vpermps with their blends. ZERO8: entry 8 is 0 (B of the
   zero code). */
typedef struct {
    __m128i b[4];
} planes16h_t;

AI planes16h_t byte_planes16(const float* t, const int ZERO8) {
    const __m128i gather = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m128i r[4];
    for (int r4 = 0; r4 < 4; ++r4) {
        __m128 x = _mm_loadu_ps(t + 4 * r4);
        if (ZERO8 && r4 == 2) x = _mm_blend_ps(x, _mm_setzero_ps(), 1);
        r[r4] = _mm_shuffle_epi8(_mm_castps_si128(x), gather); /* dword d: byte d of 4 entries */
    }
    const __m128i lo01 = _mm_unpacklo_epi32(r[0], r[1]), lo23 = _mm_unpacklo_epi32(r[2], r[3]);
    const __m128i hi01 = _mm_unpackhi_epi32(r[0], r[1]), hi23 = _mm_unpackhi_epi32(r[2], r[3]);
    planes16h_t out = {{_mm_unpacklo_epi64(lo01, lo23), _mm_unpackhi_epi64(lo01, lo23),
                        _mm_unpacklo_epi64(hi01, hi23), _mm_unpackhi_epi64(hi01, hi23)}};
    return out;
}

/* The planes of m's table in the low 128-bit lane and v's in the high one: vpshufb reads m's
   table for the codes in lane 0 and v's for those in lane 1 (dec_coat_mv16). */
typedef struct {
    __m256i b[4];
} planes_mv_t;

AI planes_mv_t planes_mv(planes16h_t m, planes16h_t v) {
    planes_mv_t out;
    for (int k = 0; k < 4; ++k)
        out.b[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(m.b[k]), v.b[k], 1);
    return out;
}

/* The floats of the 16 codes of each lane from a planes_mv_t table (idx: the entries; sign:
   or'ed into the top byte): r[q] holds codes 4q..4q+3 of m (lane 0) and of v (lane 1). */
AI void planes_mv_read(planes_mv_t t, __m256i idx, __m256i sign, __m256 r[4]) {
    __m256i x0 = _mm256_shuffle_epi8(t.b[0], idx), x1 = _mm256_shuffle_epi8(t.b[1], idx);
    __m256i x2 = _mm256_shuffle_epi8(t.b[2], idx);
    __m256i x3 = _mm256_or_si256(_mm256_shuffle_epi8(t.b[3], idx), sign);
    __m256i l01 = _mm256_unpacklo_epi8(x0, x1), h01 = _mm256_unpackhi_epi8(x0, x1);
    __m256i l23 = _mm256_unpacklo_epi8(x2, x3), h23 = _mm256_unpackhi_epi8(x2, x3);
    r[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(l01, l23));
    r[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(l01, l23));
    r[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(h01, h23));
    r[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(h01, h23));
}

/* dec_coat of 16 E4M3 codes of m and the 16 of v at the same elements (lo: codes 0-7, hi:
   8-15), bit for bit: ±A[E] · B'[i], i = j (+8 for exponent field 0), the NaN codes (0x7F,
   0xFF) at i = 8, and B'[8] = 0 (the zero code's entry): a zero or NaN code gives ±A·0 = ±0,
   the scalar (0 | sign); A is finite. The sign bit goes on A (IEEE multiplication: (-A)·B =
   -(A·B), the scalar's A·B | sign). m's codes in the low lane, v's in the high one, read from
   planes_mv_t tables: every byte of the index, sign, zero and NaN arithmetic and of the 8
   vpshufb is a code's (before, both lanes held 8 codes of one moment: the tables took 16
   registers instead of 8 and spilled; llvm-mca -mcpu=znver1: 109 -> 100 cycles per 16
   elements, znver3 50 -> 44; timed on a Zen 5 with -march=znver1, 1.01x the step's time: its
   256-bit units gain nothing from the halved vpshufb count); the products are then regrouped
   per moment by 128-bit halves. The NaN
   codes, never written by requant, come only from a loaded state. */
AI void dec_coat_mv16(const uint8_t* qm, const uint8_t* qv, planes_mv_t ta, planes_mv_t tb,
                      __m256* mlo, __m256* mhi, __m256* vlo, __m256* vhi) {
    const __m256i c = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)qm)),
        _mm_loadu_si128((const __m128i*)qv), 1);
    const __m256i b7 = _mm256_set1_epi8(0x7F), b8 = _mm256_set1_epi8(8);
    const __m256i e = _mm256_and_si256(_mm256_srli_epi16(c, 3), _mm256_set1_epi8(0x0F));
    const __m256i nan = _mm256_cmpeq_epi8(_mm256_and_si256(c, b7), b7);
    const __m256i sub = _mm256_cmpeq_epi8(_mm256_and_si256(c, _mm256_set1_epi8(0x78)),
                                          _mm256_setzero_si256());
    const __m256i j = _mm256_and_si256(c, _mm256_set1_epi8(7));
    const __m256i i = _mm256_or_si256(_mm256_andnot_si256(nan, j),
                                      _mm256_and_si256(_mm256_or_si256(sub, nan), b8));
    const __m256i sign = _mm256_and_si256(c, _mm256_set1_epi8((char)0x80));
    __m256 a[4], b[4], p[4];
    planes_mv_read(ta, e, sign, a);
    planes_mv_read(tb, i, _mm256_setzero_si256(), b);
    for (int q = 0; q < 4; ++q) p[q] = _mm256_mul_ps(a[q], b[q]);
    /* p[q] = m's codes 4q.. (low) | v's (high): m = the low halves, v = the high halves */
    *mlo = _mm256_insertf128_ps(p[0], _mm256_castps256_ps128(p[1]), 1);
    *vlo = _mm256_insertf128_ps(p[1], _mm256_extractf128_ps(p[0], 1), 0);
    *mhi = _mm256_insertf128_ps(p[2], _mm256_castps256_ps128(p[3]), 1);
    *vhi = _mm256_insertf128_ps(p[3], _mm256_extractf128_ps(p[2], 1), 0);
}

typedef struct {
    __m256 decay, step_size, w1, b2, w2, eps, inv_bc2s;
    __m256i amx, amn, avx, avn;
} upd8_t;

/* update_group's arithmetic on 8 lanes (i: the first element) from the decoded moments. */
AI void upd_v8(upd8_t* s, char* p_, const char* g_, float* restrict m_out,
               float* restrict v_out, __m256 mo, __m256 vo, int64_t i, const int PB,
               const int GB, const int SQ) {
    float* restrict p32 = (float*)p_;
    uint16_t* restrict pbf = (uint16_t*)p_;
    const float* restrict g32 = (const float*)g_;
    const uint16_t* restrict gbf = (const uint16_t*)g_;
    const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i fmin = _mm256_set1_epi32((int)FLT_MIN_BITS);
    if (SQ) vo = _mm256_mul_ps(vo, vo);
    __m256 g = GB ? bf16x8_to_f(gbf + i) : _mm256_loadu_ps(g32 + i);
    __m256 p = PB ? bf16x8_to_f(pbf + i) : _mm256_loadu_ps(p32 + i);
    __m256 mn = _mm256_add_ps(mo, _mm256_mul_ps(s->w1, _mm256_sub_ps(g, mo)));
    __m256 vn = _mm256_add_ps(_mm256_mul_ps(vo, s->b2), _mm256_mul_ps(_mm256_mul_ps(s->w2, g), g));
    __m256 rt = _mm256_sqrt_ps(vn);
    __m256 den = _mm256_add_ps(_mm256_mul_ps(rt, s->inv_bc2s), s->eps);
    __m256 pn = _mm256_sub_ps(_mm256_mul_ps(p, s->decay),
                              _mm256_div_ps(_mm256_mul_ps(s->step_size, mn), den));
    if (PB) f_to_bf16x8(pbf + i, pn); else _mm256_storeu_ps(p32 + i, pn);
    __m256 vs = SQ ? rt : vn;
    _mm256_storeu_ps(m_out + i, mn);
    _mm256_storeu_ps(v_out + i, vs);
    __m256i a = _mm256_and_si256(_mm256_castps_si256(mn), absm);
    __m256i b = _mm256_and_si256(_mm256_castps_si256(vs), absm);
    /* vmaxps(x, acc) keeps acc where x is NaN; the min-non-zero runs on |x| bits - FLT_MIN_BITS
       (unsigned: zero and subnormal magnitudes wrap above the rest) */
    s->amx = _mm256_castps_si256(
        _mm256_max_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(s->amx)));
    s->avx = _mm256_castps_si256(
        _mm256_max_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(s->avx)));
    s->amn = _mm256_min_epu32(s->amn, _mm256_sub_epi32(a, fmin));
    s->avn = _mm256_min_epu32(s->avn, _mm256_sub_epi32(b, fmin));
}

/* upd_v8 of N vectors (elements i.. i + 8N), each step applied to the N vectors before the
   next: the sqrt -> division chains of the N vectors are independent and in flight together
   (the same operations per element, the reductions in another order: max and min are exact) */
AI void upd_v8n(upd8_t* s, char* p_, const char* g_, float* restrict m_out,
                float* restrict v_out, const __m256* mo, const __m256* vo_, int64_t i,
                const int PB, const int GB, const int SQ, const int N) {
    float* restrict p32 = (float*)p_;
    uint16_t* restrict pbf = (uint16_t*)p_;
    const float* restrict g32 = (const float*)g_;
    const uint16_t* restrict gbf = (const uint16_t*)g_;
    const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i fmin = _mm256_set1_epi32((int)FLT_MIN_BITS);
    __m256 vo[4], g[4], mn[4], vn[4], rt[4], den[4], q[4]; /* N <= 4 */
    for (int u = 0; u < N; ++u) {
        vo[u] = SQ ? _mm256_mul_ps(vo_[u], vo_[u]) : vo_[u];
        g[u] = GB ? bf16x8_to_f(gbf + i + 8 * u) : _mm256_loadu_ps(g32 + i + 8 * u);
    }
    for (int u = 0; u < N; ++u) {
        mn[u] = _mm256_add_ps(mo[u], _mm256_mul_ps(s->w1, _mm256_sub_ps(g[u], mo[u])));
        vn[u] = _mm256_add_ps(_mm256_mul_ps(vo[u], s->b2),
                              _mm256_mul_ps(_mm256_mul_ps(s->w2, g[u]), g[u]));
    }
    for (int u = 0; u < N; ++u) rt[u] = _mm256_sqrt_ps(vn[u]);
    for (int u = 0; u < N; ++u) den[u] = _mm256_add_ps(_mm256_mul_ps(rt[u], s->inv_bc2s), s->eps);
    for (int u = 0; u < N; ++u) q[u] = _mm256_div_ps(_mm256_mul_ps(s->step_size, mn[u]), den[u]);
    for (int u = 0; u < N; ++u) {
        const int64_t iu = i + 8 * u;
        __m256 p = PB ? bf16x8_to_f(pbf + iu) : _mm256_loadu_ps(p32 + iu);
        __m256 pn = _mm256_sub_ps(_mm256_mul_ps(p, s->decay), q[u]);
        if (PB) f_to_bf16x8(pbf + iu, pn); else _mm256_storeu_ps(p32 + iu, pn);
        __m256 vs = SQ ? rt[u] : vn[u];
        _mm256_storeu_ps(m_out + iu, mn[u]);
        _mm256_storeu_ps(v_out + iu, vs);
        __m256i a = _mm256_and_si256(_mm256_castps_si256(mn[u]), absm);
        __m256i b = _mm256_and_si256(_mm256_castps_si256(vs), absm);
        s->amx = _mm256_castps_si256(
            _mm256_max_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(s->amx)));
        s->avx = _mm256_castps_si256(
            _mm256_max_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(s->avx)));
        s->amn = _mm256_min_epu32(s->amn, _mm256_sub_epi32(a, fmin));
        s->avn = _mm256_min_epu32(s->avn, _mm256_sub_epi32(b, fmin));
    }
}

/* update_group for E4M3 codes with expansion on 8 lanes (n a multiple of 8): 16 codes at a
   time decoded from byte planes (dec_coat_mv16) when n is a multiple of 16, else 8 with
   vpermps (dec_coat_v8); the reductions as in update_group. */
AI void update_group_ex_v8(char* p_, const char* g_, const uint8_t* restrict qm,
                           const uint8_t* restrict qv, float* restrict m_out,
                           float* restrict v_out, const float* tam, const float* tbm,
                           const float* tav, const float* tbv, const planes16h_t* cbm,
                           const planes16h_t* cbv, const float* restrict hp, int64_t n,
                           uint32_t* restrict red, const int PB, const int GB, const int SQ) {
    upd8_t s;
    s.decay = F8(hp[HP_DECAY]); s.step_size = F8(hp[HP_STEP_SIZE]);
    s.w1 = F8(hp[HP_ONE_MINUS_BETA1]); s.b2 = F8(hp[HP_BETA2]);
    s.w2 = F8(hp[HP_ONE_MINUS_BETA2]); s.eps = F8(hp[HP_EPS]);
    s.inv_bc2s = F8(hp[HP_INV_BC2]);
    s.amx = _mm256_setzero_si256(); s.amn = I8(INF_BITS - FLT_MIN_BITS);
    s.avx = s.amx; s.avn = s.amn;
    if (n % 16 == 0) {
        /* B's planes from the cache (b_planes) when given, else from the table */
        const planes_mv_t pa = planes_mv(byte_planes16(tam, 0), byte_planes16(tav, 0));
        const planes_mv_t pb = planes_mv(cbm ? *cbm : byte_planes16(tbm, 1),
                                         cbv ? *cbv : byte_planes16(tbv, 1));
        int64_t i = 0;
        for (; i + 32 <= n; i += 32) { /* 32 elements: 4 vectors of upd_v8n */
            __m256 mo[4], vo[4];
            dec_coat_mv16(qm + i, qv + i, pa, pb, &mo[0], &mo[1], &vo[0], &vo[1]);
            dec_coat_mv16(qm + i + 16, qv + i + 16, pa, pb, &mo[2], &mo[3], &vo[2], &vo[3]);
            upd_v8n(&s, p_, g_, m_out, v_out, mo, vo, i, PB, GB, SQ, 4);
        }
        for (; i < n; i += 16) {
            __m256 mo[2], vo[2];
            dec_coat_mv16(qm + i, qv + i, pa, pb, &mo[0], &mo[1], &vo[0], &vo[1]);
            upd_v8n(&s, p_, g_, m_out, v_out, mo, vo, i, PB, GB, SQ, 2);
        }
    } else {
        const dec_tab8_t tm = dec_tables_v8(tam, tbm), tv = dec_tables_v8(tav, tbv);
        for (int64_t i = 0; i < n; i += 8)
            upd_v8(&s, p_, g_, m_out, v_out, dec_coat_v8(qm + i, tm), dec_coat_v8(qv + i, tv), i,
                   PB, GB, SQ);
    }
    red[0] = hmax_epu32_8(s.amx);
    red[1] = hmin_epu32_8(s.amn) + FLT_MIN_BITS;
    red[2] = hmax_epu32_8(s.avx);
    red[3] = hmin_epu32_8(s.avn) + FLT_MIN_BITS;
}

/* fexp2 (the clamp at -126, then fexp2_nc) of N vectors of 8 lanes in place, each step on the
   N vectors before the next (the chains in flight together); the same values: max(-126, y)
   keeps a NaN y (the scalar ternary too), floor, y - floor(y) rounded to nearest as the scalar
   code, and the bit-pattern add of (int)floor(y) << 23 (vcvttps2dq: 0x80000000 for NaN, as
   the scalar conversion; the shift drops it). */
AI void fexp2_v8n(__m256* y, const int N) {
    __m256 fl[4], f[4], acc[4]; /* N <= 4 */
    for (int u = 0; u < N; ++u) {
        y[u] = _mm256_max_ps(F8(-126.0f), y[u]);
        fl[u] = _mm256_floor_ps(y[u]);
        f[u] = _mm256_sub_ps(y[u], fl[u]);
    }
    for (int u = 0; u < N; ++u) acc[u] = _mm256_add_ps(_mm256_mul_ps(f[u], F8(EXP2_C3)), F8(EXP2_C2));
    for (int u = 0; u < N; ++u) acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], f[u]), F8(EXP2_C1));
    for (int u = 0; u < N; ++u) acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], f[u]), F8(EXP2_C0));
    for (int u = 0; u < N; ++u) {
        __m256 poly = _mm256_add_ps(_mm256_mul_ps(acc[u], f[u]), F8(1.0f));
        __m256i sh = _mm256_slli_epi32(_mm256_cvttps_epi32(fl[u]), 23);
        y[u] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(poly), sh));
    }
}

/* dequant_tables' A tables of E4M3 codes (16 entries: 2 vectors per group), 2 groups at a
   time (4 exp2 chains in flight: llvm-mca's Zen 1 model had the compiler's 4-lane loop
   latency-bound) */
AI void dequant_a_v8(const float* restrict iks, const float* restrict bs, float* restrict ta,
                     int64_t stride, const float* restrict ea, int nb) {
    const __m256 e0 = _mm256_loadu_ps(ea), e1 = _mm256_loadu_ps(ea + 8);
    int j = 0;
    for (; j + 2 <= nb; j += 2) {
        __m256 y[4];
        for (int g = 0; g < 2; ++g) {
            const __m256 ik = F8(iks[j + g]), b = F8(bs[j + g]);
            /* (y > max) ? max : y, as vminps(max, y): a NaN y stays NaN */
            y[2 * g] = _mm256_min_ps(F8(DEC_Y_MAX), _mm256_add_ps(_mm256_mul_ps(e0, ik), b));
            y[2 * g + 1] = _mm256_min_ps(F8(DEC_Y_MAX), _mm256_add_ps(_mm256_mul_ps(e1, ik), b));
        }
        fexp2_v8n(y, 4);
        for (int g = 0; g < 2; ++g) {
            _mm256_storeu_ps(ta + (j + g) * stride, y[2 * g]);
            _mm256_storeu_ps(ta + (j + g) * stride + 8, y[2 * g + 1]);
        }
    }
    if (j < nb) {
        const __m256 ik = F8(iks[j]), b = F8(bs[j]);
        __m256 y[2] = {_mm256_min_ps(F8(DEC_Y_MAX), _mm256_add_ps(_mm256_mul_ps(e0, ik), b)),
                       _mm256_min_ps(F8(DEC_Y_MAX), _mm256_add_ps(_mm256_mul_ps(e1, ik), b))};
        fexp2_v8n(y, 2);
        _mm256_storeu_ps(ta + j * stride, y[0]);
        _mm256_storeu_ps(ta + j * stride + 8, y[1]);
    }
}

/* The B table of a group depends on its exponent k alone (coat.dequantize_groups: B[i] =
   fast_exp2(db[i]·(1/k)), db fixed), and a tensor's groups share a few dozen values of k (a
   multiple of 1/16: 37 and 19 distinct values for m and v in 131,072 groups of the benchmark's
   embedding): each thread keeps the byte planes (byte_planes16, entry 8 zeroed) of the B tables
   of the last k seen per slot, tagged with k's bit pattern (any k: the tag is exact), instead of
   16 exp2 and a transposition per group and moment (0.97-0.99x the step's time). The same fp32
   operations as dequant_tables' B (fexp2(db[i] * (1.0f / k))), so the same bits. */
#define B_CACHE_SLOTS 64
typedef struct {
    uint64_t tag[B_CACHE_SLOTS]; /* (1 << 32) | bits of k; 0: empty */
    planes16h_t planes[B_CACHE_SLOTS];
} b_cache_t;
/* zeroed: every slot empty; per thread (no sharing), one per moment (the pointers that
   b_planes returns for m and v stay valid together) */
static __thread b_cache_t b_cache[2];

AI const planes16h_t* b_planes(b_cache_t* c, float k, const float* db) {
    const uint32_t bits = f2b(k);
    const uint32_t slot = (bits * 0x9E3779B1u) >> (32 - 6); /* 64 slots */
    const uint64_t tag = (1ull << 32) | bits;
    if (c->tag[slot] != tag) {
        float tb[16];
        const float ik = 1.0f / k;
        for (int i = 0; i < 16; ++i) tb[i] = fexp2(db[i] * ik);
        c->planes[slot] = byte_planes16(tb, 1);
        c->tag[slot] = tag;
    }
    return &c->planes[slot];
}

/* requant's EX branch for E4M3 codes on U vectors of 8 lanes at a time (n a multiple of 8·U),
   each step applied to the U vectors before the next (interleaved polynomial chains: U = 8,
   64 elements, took 0.85x the whole step's time of U = 4 (-march=znver1 code timed on a Zen 5;
   llvm-mca's Zen 1 model: the requantization latency-bound, 0.87x), despite spills). The
   scalar loop's operations, except where the result is the same by construction:
   - flog2 of |x| itself, not of (nz ? |x| : 1): the lanes that differ are zeroed by nz;
   - nz ? mag : 0 as an AND with the mask, min(mag, F) as vminps (mag is never NaN);
   - rint(mag·512) of the subnormal codes as vcvtps2dq (the MXCSR rounding of the scalar
     code's MAGIC add), floor(mag·512 + u) as vroundps then vcvttps2dq (an integer < 9);
   - the SR normal code (mag + low) >> 20 without clearing the low bits first. */
AI void requant_e4m3_ex_v8(const float* restrict buf, uint8_t* restrict q, int64_t n, int64_t gs,
                           float k, float lmax, uint32_t key, const int SR, const int U) {
    const __m256 kv = F8(k), lm = F8(lmax);
    const __m256i dh = I8(8u * (uint32_t)SR_WEYL);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i h = _mm256_mullo_epi32(_mm256_add_epi32(I8(key), lanes), I8((uint32_t)SR_WEYL));
    for (int64_t i0 = 0; i0 < n; i0 += 8 * U) {
        __m256i xb[8], ab[8], c[8]; /* U <= 8 */
        __m256 tm[8], acc[8], y[8], f[8], mag[8], nz[8];
        for (int u = 0; u < U; ++u) {
            xb[u] = _mm256_castps_si256(_mm256_loadu_ps(buf + i0 + 8 * u));
            ab[u] = _mm256_and_si256(xb[u], I8(0x7FFFFFFF));
            /* |x| >= FLT_MIN (false for NaN) */
            nz[u] = _mm256_cmp_ps(_mm256_castsi256_ps(ab[u]), F8(FLT_MIN_F), _CMP_GE_OQ);
            __m256i m = _mm256_or_si256(_mm256_and_si256(ab[u], I8(0x7FFFFF)), I8(0x3F800000));
            tm[u] = _mm256_sub_ps(_mm256_castsi256_ps(m), F8(1.0f));
        }
        for (int u = 0; u < U; ++u)
            acc[u] = _mm256_add_ps(_mm256_mul_ps(tm[u], F8(LOG2_C5)), F8(LOG2_C4));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], tm[u]), F8(LOG2_C3));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], tm[u]), F8(LOG2_C2));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], tm[u]), F8(LOG2_C1));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], tm[u]), F8(LOG2_C0));
        for (int u = 0; u < U; ++u) {
            __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(ab[u], 23), I8(127)));
            __m256 lx = _mm256_add_ps(e, _mm256_mul_ps(acc[u], tm[u]));
            y[u] = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(lx, lm), kv), F8(E4M3_LOG2MAX));
        }
        /* fexp2_nc */
        for (int u = 0; u < U; ++u) {
            f[u] = _mm256_sub_ps(y[u], _mm256_floor_ps(y[u]));
            acc[u] = _mm256_add_ps(_mm256_mul_ps(f[u], F8(EXP2_C3)), F8(EXP2_C2));
        }
        for (int u = 0; u < U; ++u)
            acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], f[u]), F8(EXP2_C1));
        for (int u = 0; u < U; ++u)
            acc[u] = _mm256_add_ps(_mm256_mul_ps(acc[u], f[u]), F8(EXP2_C0));
        for (int u = 0; u < U; ++u) {
            __m256 poly = _mm256_add_ps(_mm256_mul_ps(acc[u], f[u]), F8(1.0f));
            __m256i sh = _mm256_slli_epi32(_mm256_cvttps_epi32(_mm256_floor_ps(y[u])), 23);
            mag[u] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(poly), sh));
            mag[u] = _mm256_min_ps(_mm256_and_ps(mag[u], nz[u]), F8(E4M3_MAX));
#ifdef REQUANT_PROBE_V8 /* tests only: the magnitude before the cast */
            REQUANT_PROBE_V8(i0 + 8 * u, mag[u]);
#endif
        }
        if (SR) {
            for (int u = 0; u < U; ++u) {
                __m256i low = _mm256_srli_epi32(h, 32 - E4M3_SR_DROP);
                h = _mm256_add_epi32(h, dh);
                __m256i mb = _mm256_castps_si256(mag[u]);
                __m256i cn = _mm256_sub_epi32(
                    _mm256_srli_epi32(_mm256_add_epi32(mb, low), E4M3_SR_DROP), I8(120 << 3));
                __m256 uu = _mm256_mul_ps(_mm256_cvtepi32_ps(low), F8(E4M3_SR_UNIT));
                __m256i cs = _mm256_cvttps_epi32(_mm256_floor_ps(
                    _mm256_add_ps(_mm256_mul_ps(mag[u], F8(E4M3_SR_STEPS)), uu)));
                __m256 sub = _mm256_cmp_ps(mag[u], F8(E4M3_SR_MIN_NORMAL), _CMP_LT_OQ);
                c[u] = _mm256_blendv_epi8(cn, cs, _mm256_castps_si256(sub));
                c[u] = _mm256_min_epu32(c[u], I8(0x7E));
            }
        } else {
            for (int u = 0; u < U; ++u) {
                __m256i mb = _mm256_castps_si256(mag[u]);
                __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mb, 20), I8(1));
                __m256i cn = _mm256_sub_epi32(
                    _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mb, I8(0x7FFFF)), lsb), 20),
                    I8(120 << 3));
                __m256i cs = _mm256_cvtps_epi32(_mm256_mul_ps(mag[u], F8(512.0f)));
                __m256 sub = _mm256_cmp_ps(mag[u], F8(0.015625f), _CMP_LT_OQ);
                c[u] = _mm256_blendv_epi8(cn, cs, _mm256_castps_si256(sub));
            }
        }
        if (U % 4 == 0) {
            /* each 32 codes packed to bytes (values <= 0x7E: no saturation) and x packed alike
               with signed saturation, which keeps the sign bit: a byte of x's pack has bit 7
               set exactly when x has bit 31 set; then the bytes in order (the packs work per
               128-bit lane: dword d of lane l holds 4 codes of vector d at offset 4l) */
            for (int u = 0; u < U; u += 4) {
                __m256i cb = _mm256_packus_epi16(_mm256_packus_epi32(c[u], c[u + 1]),
                                                 _mm256_packus_epi32(c[u + 2], c[u + 3]));
                __m256i sb = _mm256_packs_epi16(_mm256_packs_epi32(xb[u], xb[u + 1]),
                                                _mm256_packs_epi32(xb[u + 2], xb[u + 3]));
                __m256i code =
                    _mm256_or_si256(cb, _mm256_and_si256(sb, _mm256_set1_epi8((char)0x80)));
                code = _mm256_permutevar8x32_epi32(code, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256((__m256i*)(q + i0 + 8 * u), code);
            }
        } else {
            for (int u = 0; u < U; ++u) { /* | the sign bit (bit 31 of x moved to bit 7) */
                __m256i code = _mm256_or_si256(
                    c[u], _mm256_and_si256(_mm256_srli_epi32(xb[u], 24), I8(0x80)));
                __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code),
                                             _mm256_extracti128_si256(code, 1));
                _mm_storel_epi64((__m128i*)(q + i0 + 8 * u), _mm_packus_epi16(w, w));
            }
        }
    }
    for (int64_t i = n; i < gs; ++i) q[i] = 0;
}

/* Other multiples of 8 (group sizes other than the default): out of line, so that the default
   path's inlined loops stay alone in run_groups (with these inlined too the step took 1.05x). */
__attribute__((noinline)) static void requant_e4m3_ex_v8_other(const float* restrict buf,
                                                               uint8_t* restrict q, int64_t n,
                                                               int64_t gs, float k, float lmax,
                                                               uint32_t key, const int SR) {
    if (SR) {
        if (n % 32 == 0) requant_e4m3_ex_v8(buf, q, n, gs, k, lmax, key, 1, 4);
        else requant_e4m3_ex_v8(buf, q, n, gs, k, lmax, key, 1, 1);
    } else {
        if (n % 32 == 0) requant_e4m3_ex_v8(buf, q, n, gs, k, lmax, key, 0, 4);
        else requant_e4m3_ex_v8(buf, q, n, gs, k, lmax, key, 0, 1);
    }
}
#undef I8
#undef F8
#endif

/* enc_fp8 of a magnitude known to be in [0, F] (not NaN), with the sign bit s (0x80 or 0) of
   the value: the same code without the sign / NaN handling of the general cast. */
AI uint8_t enc_fp8_mag(float a, uint32_t s, const int E5) {
    uint32_t ab = f2b(a), c;
    if (E5) {
        uint32_t cn = ((ab + 0xFFFFFu + ((ab >> 21) & 1u)) >> 21) - (112u << 2);
        uint32_t cs = f2b(a * 65536.0f + MAGIC) - MAGIC_BITS;
        c = (a < 6.103515625e-05f) ? cs : cn;
    } else {
        uint32_t cn = ((ab + 0x7FFFFu + ((ab >> 20) & 1u)) >> 20) - (120u << 3);
        uint32_t cs = f2b(a * 512.0f + MAGIC) - MAGIC_BITS;
        c = (a < 0.015625f) ? cs : cn;
    }
    return (uint8_t)(c | s);
}

AI float bf16_to_f(uint16_t h) { return b2f(((uint32_t)h) << 16); }
AI uint16_t f_to_bf16(float f) {
    uint32_t u = f2b(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7FFFFFFFu) > INF_BITS) ? 0x7FC0u : r);
}

/* coat.random_bits of element i of a stream: (key + i)·SR_WEYL mod 2^32 (top bits used). */
AI uint32_t sr_bits(uint32_t key, uint32_t i) { return (key + i) * (uint32_t)SR_WEYL; }

/* coat.stochastic_round_magnitude: a (0 <= a <= F) to an fp8 value, up with probability
   proportional to the distance, from the random bits r (the top SR_DROP of them). */
AI float sr_mag(float a, uint32_t r, const int E5) {
    const uint32_t drop = E5 ? E5M2_SR_DROP : E4M3_SR_DROP;
    const uint32_t mask = (1u << drop) - 1u;
    const float F = E5 ? E5M2_MAX : E4M3_MAX;
    const float steps = E5 ? E5M2_SR_STEPS : E4M3_SR_STEPS;
    const float inv_steps = E5 ? E5M2_SR_INV_STEPS : E4M3_SR_INV_STEPS;
    const float unit = E5 ? E5M2_SR_UNIT : E4M3_SR_UNIT;
    const float min_normal = E5 ? E5M2_SR_MIN_NORMAL : E4M3_SR_MIN_NORMAL;
    uint32_t low = r >> (32u - drop);
    float normal = b2f((f2b(a) + low) & ~mask);
    float u = (float)(int32_t)low * unit;
    float sub = floorf(a * steps + u) * inv_steps;
    float out = (a < min_normal) ? sub : normal;
    return (out > F) ? F : out;
}

/* enc_fp8(copysign(sr_mag(a, r), x)) in one go (s: the sign bit of x as 0x80 or 0): the
   stochastically rounded value is representable, so its code is read off directly (normal:
   the top bits of its pattern; subnormal: the integer floor(a·steps + u); above F: F's code). */
AI uint8_t sr_code(float a, uint32_t r, uint32_t s, const int E5) {
    const uint32_t drop = E5 ? E5M2_SR_DROP : E4M3_SR_DROP;
    const uint32_t mask = (1u << drop) - 1u;
    const uint32_t cmax = E5 ? 0x7Bu : 0x7Eu; /* the code of F */
    const float steps = E5 ? E5M2_SR_STEPS : E4M3_SR_STEPS;
    const float unit = E5 ? E5M2_SR_UNIT : E4M3_SR_UNIT;
    const float min_normal = E5 ? E5M2_SR_MIN_NORMAL : E4M3_SR_MIN_NORMAL;
    uint32_t low = r >> (32u - drop);
    uint32_t cn = (((f2b(a) + low) & ~mask) >> drop) - (E5 ? (112u << 2) : (120u << 3));
    float u = (float)(int32_t)low * unit;
    uint32_t cs = (uint32_t)(int32_t)floorf(a * steps + u);
    uint32_t c = (a < min_normal) ? cs : cn;
    c = (c > cmax) ? cmax : c;
    c = (f2b(a) > INF_BITS) ? 0x7Fu : c; /* NaN (not reached from requant: kept for safety) */
    return (uint8_t)(c | s);
}

AI float expansion_k(float amax, float amin, float steps) {
    int valid = amax >= FLT_MIN_F;
    float lr = flog2(valid ? amax : 1.0f) - flog2(valid ? amin : 1.0f);
    int ex = lr > 0.0f;
    float st = (1.0f / (ex ? lr : 1.0f)) * steps;
    float k = ex ? floorf(st) * INV_STEPS : 1.0f;
    k = (k < K_MIN) ? K_MIN : k;
    k = (k > K_MAX) ? K_MAX : k;
    return k;
}

/* The plain (absmax) codes of buf[0:n] with the divisor ss: a NaN element gets code 0; NZ: a
   non-zero element (|x| >= FLT_MIN) at least the smallest subnormal code (coat.quantize_groups'
   keep_nonzero). */
AI void requant_plain(const float* restrict buf, uint8_t* restrict q, int64_t n, float ss,
                      int valid, uint32_t key, const int E5, const int SR, const int NZ) {
    const float F = E5 ? E5M2_MAX : E4M3_MAX;
    for (uint32_t i = 0; i < (uint32_t)n; ++i) {
        float x = buf[i];
        float v = x / ss; /* computed unconditionally and masked: the loop vectorizes */
        v = (v < -F) ? -F : v;
        v = (v > F) ? F : v;
        v = (valid & (x == x)) ? v : 0.0f;
        if (SR) v = copysignf(sr_mag(fabsf(v), sr_bits(key, i), E5), v);
        uint8_t c = enc_fp8(v, E5);
        if (NZ) { /* never the zero code: max(c, 1) for |x| >= FLT_MIN (one vector max) */
            uint8_t nz = fabsf(x) >= FLT_MIN_F;
            c = (c > nz) ? c : nz;
        }
        q[i] = c;
    }
}

/* Quantize one group held in fp32 in buf[0:n] with its exponent k and log2(amax) (EX) or
   its amax (plain); codes n..gs-1 are set to 0. Plain: see requant_plain; NZ (the second
   moment) applies to groups whose smallest non-zero element (amin, the bit-pattern min of
   |x| >= FLT_MIN, inf if none) falls below the smallest code: elsewhere it is a no-op (x / ss
   is monotone), and the common loop keeps its cost. EX writes code 0 for NaN (nz is false)
   and never rounds a non-zero element to 0. */
AI void requant(const float* restrict buf, uint8_t* restrict q, int64_t n, int64_t gs,
                float k, float lmax, float amax, float amin, uint32_t key, const int E5,
                const int EX, const int SR, const int NZ) {
    const float F = E5 ? E5M2_MAX : E4M3_MAX;
    const float LOG2F = E5 ? E5M2_LOG2MAX : E4M3_LOG2MAX;
    int valid = amax >= FLT_MIN_F;
#if HAVE_DEC_AVX512
    if (EX && !E5 && n % 128 == 0) {
        requant_e4m3_ex_v(buf, q, n, gs, k, lmax, key, SR, 8);
        return;
    }
    if (EX && !E5 && n % 16 == 0) {
        requant_e4m3_ex_v(buf, q, n, gs, k, lmax, key, SR, 1);
        return;
    }
#endif
#if HAVE_AVX2_PATH
    if (EX && !E5 && n % 64 == 0) {
        requant_e4m3_ex_v8(buf, q, n, gs, k, lmax, key, SR, 8);
        return;
    }
    if (EX && !E5 && n % 8 == 0) {
        requant_e4m3_ex_v8_other(buf, q, n, gs, k, lmax, key, SR);
        return;
    }
#endif
    if (EX) {
        for (uint32_t i = 0; i < (uint32_t)n; ++i) { /* 32-bit index: key + i in 32-bit lanes */
            float x = buf[i];
            float ax = fabsf(x);
            int nz = ax >= FLT_MIN_F;
            /* y >= LOG2F - log2(F^2/2) > -126 for non-zero x: k (lmax - lmin) <= log2(F^2/2),
               so the clamp of fexp2 is a no-op; zero lanes are masked below. */
            float y = (flog2(nz ? ax : 1.0f) - lmax) * k + LOG2F;
            float mag = fexp2_nc(y);
            mag = nz ? mag : 0.0f;
            mag = (mag > F) ? F : mag;
#ifdef REQUANT_PROBE_S /* tests only: the magnitude before the cast */
            REQUANT_PROBE_S(i, mag);
#endif
            if (SR)
                q[i] = sr_code(mag, sr_bits(key, i), (f2b(x) >> 24) & 0x80u, E5);
            else /* mag in [0, F]: y is finite and >= -126 (see above) */
                q[i] = enc_fp8_mag(mag, (f2b(x) >> 24) & 0x80u, E5);
        }
    } else {
        float s = amax / F;
        float ss = valid ? s : 1.0f;
        if (NZ && amin / ss < (E5 ? E5M2_MIN_SUB : E4M3_MIN_SUB))
            requant_plain(buf, q, n, ss, valid, key, E5, SR, 1);
        else
            requant_plain(buf, q, n, ss, valid, key, E5, SR, 0);
    }
    for (int64_t i = n; i < gs; ++i) q[i] = 0;
}

/* The decode tables of each group of a chunk (coat.dequantize_groups): ta[j] = A (DEC_NA
   entries: fast_exp2(min(ea·(1/k) + b, DEC_Y_MAX))), tb[j] = B (DEC_NB: fast_exp2(db·(1/k))),
   b = flog2(amax) - (1/k)·log2 F; the inner loops vectorize. */
#define CHUNK 16 /* groups processed together: their per-group scalars are vectorized */
#define DEC_NA 32 /* 2^(7 - mb): 16 for E4M3, 32 for E5M2 */
#define DEC_NB 16 /* 2^(mb + 1): 16 for E4M3, 8 for E5M2 */
AI void dequant_tables(const float* restrict scale, const float* restrict expo,
                       float (*restrict ta)[DEC_NA], float (*restrict tb)[DEC_NB],
                       const float* restrict ea, const float* restrict db, int nb, float F,
                       float LOG2F, const int E5, const int NO_B) {
    const int na = E5 ? 32 : 16, nbb = E5 ? 8 : 16;
    float iks[CHUNK], bs[CHUNK];
    for (int j = 0; j < nb; ++j) { /* the per-group scalars, vectorized across the groups */
        const float amax = scale[j] * F;
        iks[j] = 1.0f / expo[j];
        bs[j] = flog2((amax >= FLT_MIN_F) ? amax : 1.0f) - iks[j] * LOG2F;
    }
#if HAVE_DEC_AVX512
    if (!E5) { /* E4M3: one vector of A and one of B per group */
        const __m512 eav = _mm512_loadu_ps(ea), dbv = _mm512_loadu_ps(db);
        for (int j = 0; j < nb; ++j) {
            const __m512 ik = _mm512_set1_ps(iks[j]);
            __m512 y = _mm512_add_ps(_mm512_mul_ps(eav, ik), _mm512_set1_ps(bs[j]));
            y = _mm512_min_ps(_mm512_set1_ps(DEC_Y_MAX), y); /* (y > max) ? max : y */
            _mm512_storeu_ps(ta[j], fexp2_v(y, 1));
            if (!NO_B) /* B from b_table16 */
                _mm512_storeu_ps(tb[j], fexp2_v(_mm512_mul_ps(dbv, ik), 1));
        }
        return;
    }
#endif
#if HAVE_AVX2_PATH
    if (!E5) { /* E4M3: A on 8 lanes; B as below */
        dequant_a_v8(iks, bs, &ta[0][0], DEC_NA, ea, nb);
        if (!NO_B)
            for (int j = 0; j < nb; ++j)
                for (int i = 0; i < nbb; ++i) tb[j][i] = fexp2(db[i] * iks[j]);
        return;
    }
#endif
    for (int j = 0; j < nb; ++j) {
        const float ik = iks[j], b = bs[j];
        for (int e = 0; e < na; ++e) {
            float y = ea[e] * ik + b;
            ta[j][e] = fexp2((y > DEC_Y_MAX) ? DEC_Y_MAX : y);
        }
        if (!NO_B) /* B from b_planes */
            for (int i = 0; i < nbb; ++i) tb[j][i] = fexp2(db[i] * ik);
    }
}

AI void quant_consts(const uint32_t* restrict bmax, const uint32_t* restrict bmin,
                     float* restrict scale, float* restrict expo, float* restrict amax,
                     float* restrict k, float* restrict lmax, int nb, float F, float steps,
                     const int EX) {
    for (int j = 0; j < nb; ++j) {
        /* an infinite maximum (a moment that overflowed) saturates to FLT_MAX (coat) */
        amax[j] = b2f((bmax[j] == INF_BITS) ? FLT_MAX_BITS : bmax[j]);
        scale[j] = amax[j] / F;
    }
    if (!EX) return;
    for (int j = 0; j < nb; ++j) {
        k[j] = expansion_k(amax[j], b2f(bmin[j]), steps);
        lmax[j] = flog2((amax[j] >= FLT_MIN_F) ? amax[j] : 1.0f);
        expo[j] = k[j];
    }
}

/* coat.dequantize_groups with expansion of one code, from its group's tables. */
AI float dec_coat(uint8_t c, const float* restrict ta, const float* restrict tb, const int E5) {
    const uint32_t mb = E5 ? 2u : 3u, a = c & 0x7Fu, e = a >> mb, j = a & ((1u << mb) - 1u);
    const uint32_t i = (e == 0u) ? j + (1u << mb) : j;
    float mag = ta[e] * tb[i];
    int ok = (a != 0u) & (E5 ? (e != 31u) : (a != 0x7Fu)); /* zero and non-finite codes: 0 */
    return b2f((ok ? f2b(mag) : 0u) | (((uint32_t)(c & 0x80u)) << 24));
}

/* Dequantize, AdamW-update and store the new moments of one group (n elements);
   red receives the bit-pattern max (NaN left out) / min-non-zero of |m| and v. */
AI void update_group(char* p_, const char* g_, const uint8_t* restrict qm,
                     const uint8_t* restrict qv, float* restrict m_out, float* restrict v_out,
                     float sm, float sv, const float* restrict tam, const float* restrict tbm,
                     const float* restrict tav, const float* restrict tbv,
                     const float* restrict hp, int64_t n, uint32_t* restrict red,
                     const int PB, const int GB, const int E5, const int EX, const int SQ) {
    const float decay = hp[HP_DECAY], step_size = hp[HP_STEP_SIZE], w1 = hp[HP_ONE_MINUS_BETA1];
    const float b2 = hp[HP_BETA2], w2 = hp[HP_ONE_MINUS_BETA2];
    const float eps = hp[HP_EPS], inv_bc2s = hp[HP_INV_BC2];
    float* restrict p32 = (float*)p_;
    uint16_t* restrict pbf = (uint16_t*)p_;
    const float* restrict g32 = (const float*)g_;
    const uint16_t* restrict gbf = (const uint16_t*)g_;
    uint32_t amx = 0u, amn = INF_BITS, avx = 0u, avn = INF_BITS;
    for (int64_t i = 0; i < n; ++i) {
        float mo, vo;
        if (EX) {
            mo = dec_coat(qm[i], tam, tbm, E5);
            vo = dec_coat(qv[i], tav, tbv, E5);
        } else {
            mo = dec_fp8(qm[i], E5) * sm;
            vo = dec_fp8(qv[i], E5) * sv;
        }
        if (SQ) vo = vo * vo; /* the second moment is stored as sqrt(v) */
        float g = GB ? bf16_to_f(gbf[i]) : g32[i];
        float p = PB ? bf16_to_f(pbf[i]) : p32[i];
        float mn = mo + w1 * (g - mo);
        float vn = vo * b2 + w2 * g * g;
        float rt = sqrtf(vn);
        float den = rt * inv_bc2s + eps;
        float pn = p * decay - step_size * mn / den;
        if (PB) pbf[i] = f_to_bf16(pn); else p32[i] = pn;
        m_out[i] = mn;
        float vs_ = SQ ? rt : vn;
        v_out[i] = vs_;
        uint32_t a = f2b(mn) & 0x7FFFFFFFu, b = f2b(vs_) & 0x7FFFFFFFu;
        uint32_t af = a & not_nan(a), bf = b & not_nan(b); /* NaN: not the maximum */
        amx = (af > amx) ? af : amx;
        avx = (bf > avx) ? bf : avx;
        /* NaN bits exceed INF_BITS, the min's start: never the minimum */
        uint32_t an = (a >= FLT_MIN_BITS) ? a : INF_BITS;
        uint32_t bn = (b >= FLT_MIN_BITS) ? b : INF_BITS;
        amn = (an < amn) ? an : amn;
        avn = (bn < avn) ? bn : avn;
    }
    red[0] = amx; red[1] = amn; red[2] = avx; red[3] = avn;
}

#if HAVE_DEC_AVX512
typedef struct {
    __m512 decay, step_size, w1, b2, w2, eps, inv_bc2s;
    __m512i amx, amn, avx, avn;
} upd16_t;

/* update_group's arithmetic on N vectors of 16 lanes (elements i.. i + 16N) from the decoded
   moments, the scalar loop's fp32 operations in the same order; each step applied to the N
   vectors before the next, so that the square root -> division chains of the N vectors are in
   flight together (N = 4: 0.98x the step's time of one vector at a time); the reductions as in
   update_group (in another order: max and min are exact). vmaxps(x, acc) returns acc where x is
   NaN: NaN left out of the max for free (on non-negative floats the float max is the
   bit-pattern max); the min-non-zero reductions run on |x| bits - FLT_MIN_BITS (unsigned): zero
   and subnormal magnitudes wrap above every normal one, NaN stays above INF_BITS -
   FLT_MIN_BITS, the start; one vpminud instead of a compare and a masked min. */
AI void upd_v16(upd16_t* s, char* p_, const char* g_, float* restrict m_out,
                float* restrict v_out, const __m512* mo, const __m512* vo_, int64_t i,
                const int PB, const int GB, const int SQ, const int N) {
    float* restrict p32 = (float*)p_;
    uint16_t* restrict pbf = (uint16_t*)p_;
    const float* restrict g32 = (const float*)g_;
    const uint16_t* restrict gbf = (const uint16_t*)g_;
    const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), fmin = _mm512_set1_epi32((int)FLT_MIN_BITS);
    __m512 vo[4], g[4], mn[4], vn[4], rt[4], den[4], q[4]; /* N <= 4 */
    for (int u = 0; u < N; ++u) {
        vo[u] = SQ ? _mm512_mul_ps(vo_[u], vo_[u]) : vo_[u];
        g[u] = GB ? bf16x16_to_f(gbf + i + 16 * u) : _mm512_loadu_ps(g32 + i + 16 * u);
    }
    for (int u = 0; u < N; ++u) {
        mn[u] = _mm512_add_ps(mo[u], _mm512_mul_ps(s->w1, _mm512_sub_ps(g[u], mo[u])));
        vn[u] = _mm512_add_ps(_mm512_mul_ps(vo[u], s->b2),
                              _mm512_mul_ps(_mm512_mul_ps(s->w2, g[u]), g[u]));
    }
    for (int u = 0; u < N; ++u) rt[u] = _mm512_sqrt_ps(vn[u]);
    for (int u = 0; u < N; ++u) den[u] = _mm512_add_ps(_mm512_mul_ps(rt[u], s->inv_bc2s), s->eps);
    for (int u = 0; u < N; ++u) q[u] = _mm512_div_ps(_mm512_mul_ps(s->step_size, mn[u]), den[u]);
    for (int u = 0; u < N; ++u) {
        const int64_t iu = i + 16 * u;
        __m512 p = PB ? bf16x16_to_f(pbf + iu) : _mm512_loadu_ps(p32 + iu);
        __m512 pn = _mm512_sub_ps(_mm512_mul_ps(p, s->decay), q[u]);
        if (PB) f_to_bf16x16(pbf + iu, pn); else _mm512_storeu_ps(p32 + iu, pn);
        __m512 vs = SQ ? rt[u] : vn[u];
        _mm512_storeu_ps(m_out + iu, mn[u]);
        _mm512_storeu_ps(v_out + iu, vs);
        __m512i a = _mm512_and_si512(_mm512_castps_si512(mn[u]), absm);
        __m512i b = _mm512_and_si512(_mm512_castps_si512(vs), absm);
        s->amx = _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(s->amx)));
        s->avx = _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(s->avx)));
        s->amn = _mm512_min_epu32(s->amn, _mm512_sub_epi32(a, fmin));
        s->avn = _mm512_min_epu32(s->avn, _mm512_sub_epi32(b, fmin));
    }
}

#if HAVE_VBMI
/* The B-table index of every E4M3 code's low 7 bits (one two-table byte permute reads it for
   64 codes): j for a normal code (exponent field E > 0), 8 + j for a subnormal one (E = 0),
   8 for the NaN code 0x7F; entry 8 of the table is 0 (dec_coat_vb), so that the zero codes
   (8 + 0) and the NaN codes decode to ±A·0 = ±0 without a mask. */
static const uint8_t BIDX_E4M3[128] __attribute__((aligned(64))) = {
    8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 8};

/* dec_coat_v with the B index of each code from BIDX_E4M3 (lo: entries 0-63, hi: 64-127): one
   byte permute of the zero-extended codes, zero-masked to byte 0 of each dword (bit 7, the
   sign, is not an index bit), then ±A[sign, E] · b[index] from one 16-entry B table b (B[0:8]
   normal, 0, B[9:16] subnormal). The same values: a zero code gives ±A[0]·0 = ±0 as before, a
   NaN code ±A[15]·0 = ±0 (the reference's 0 | sign; dec_coat_v gives +0: a zero moment's
   sign changes no result). */
AI __m512 dec_coat_vb(const uint8_t* q, __m512i lo, __m512i hi, __m512 a, __m512 na, __m512 b) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    __m512i j = _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, lo, c, hi);
    return _mm512_mul_ps(_mm512_permutex2var_ps(a, _mm512_srli_epi32(c, 3), na),
                         _mm512_permutexvar_ps(j, b));
}
#endif

/* The B table of a group depends on its exponent k alone (coat.dequantize_groups: B[i] =
   fast_exp2(db[i]·(1/k))), and a tensor's groups share a few dozen values of k: each thread
   keeps the B tables of the last k seen per slot, tagged with k's bit pattern (any k: the
   tag is exact), instead of an exp2 polynomial per group and moment (dequant_tables with
   NO_B). The same fp32 operations as dequant_tables' B (fexp2_v(db · (1.0f / k))), so the
   same bits (test_kernel_requant_exact). As b_planes of the AVX2 loops. */
#define B16_SLOTS 64
typedef struct {
    float tb[B16_SLOTS][16] __attribute__((aligned(64)));
    uint64_t tag[B16_SLOTS]; /* (1 << 32) | bits of k; 0: empty */
} b_cache16_t;
/* zeroed: every slot empty; per thread, one per moment (the pointers that b_table16 returns for
   m and v stay valid together) */
static __thread b_cache16_t b_cache16[2];

AI const float* b_table16(b_cache16_t* c, float k, const float* db) {
    const uint32_t bits = f2b(k);
    const uint32_t slot = (bits * 0x9E3779B1u) >> (32 - 6); /* 64 slots */
    const uint64_t tag = (1ull << 32) | bits;
    if (c->tag[slot] != tag) {
        const __m512 ik = _mm512_set1_ps(1.0f / k);
        _mm512_store_ps(c->tb[slot], fexp2_v(_mm512_mul_ps(_mm512_loadu_ps(db), ik), 1));
        c->tag[slot] = tag;
    }
    return c->tb[slot];
}

/* update_group for E4M3 codes with expansion on 16 lanes (n a multiple of 16): each vector of
   codes is decoded in registers (dec_coat_vb with VBMI, else dec_coat_v)
   and updated with the scalar loop's fp32 operations in the same order (upd_v16); the
   reductions as in update_group. */
AI void update_group_ex_v(char* p_, const char* g_, const uint8_t* restrict qm,
                          const uint8_t* restrict qv, float* restrict m_out,
                          float* restrict v_out, const float* tam, const float* tbm,
                          const float* tav, const float* tbv, const float* restrict hp,
                          int64_t n, uint32_t* restrict red, const int PB, const int GB,
                          const int SQ) {
    upd16_t s;
    s.decay = _mm512_set1_ps(hp[HP_DECAY]); s.step_size = _mm512_set1_ps(hp[HP_STEP_SIZE]);
    s.w1 = _mm512_set1_ps(hp[HP_ONE_MINUS_BETA1]); s.b2 = _mm512_set1_ps(hp[HP_BETA2]);
    s.w2 = _mm512_set1_ps(hp[HP_ONE_MINUS_BETA2]); s.eps = _mm512_set1_ps(hp[HP_EPS]);
    s.inv_bc2s = _mm512_set1_ps(hp[HP_INV_BC2]);
    s.amx = _mm512_setzero_si512(); s.amn = _mm512_set1_epi32((int)(INF_BITS - FLT_MIN_BITS));
    s.avx = s.amx; s.avn = s.amn;
#if HAVE_VBMI
    {
        const __m512i blo = _mm512_load_si512((const void*)BIDX_E4M3);
        const __m512i bhi = _mm512_load_si512((const void*)(BIDX_E4M3 + 64));
        const __m512i sgn = _mm512_set1_epi32((int)0x80000000u);
        const __m512 am = _mm512_loadu_ps(tam), av = _mm512_loadu_ps(tav);
        const __m512 nam = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(am), sgn));
        const __m512 nav = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(av), sgn));
        const __m512 bm = _mm512_maskz_loadu_ps(0xFEFF, tbm), bv = _mm512_maskz_loadu_ps(0xFEFF, tbv);
        int64_t i = 0;
        for (; i + 64 <= n; i += 64) { /* 4 vectors at a time */
            __m512 mo[4], vo[4];
            for (int u = 0; u < 4; ++u) {
                mo[u] = dec_coat_vb(qm + i + 16 * u, blo, bhi, am, nam, bm);
                vo[u] = dec_coat_vb(qv + i + 16 * u, blo, bhi, av, nav, bv);
            }
            upd_v16(&s, p_, g_, m_out, v_out, mo, vo, i, PB, GB, SQ, 4);
        }
        for (; i < n; i += 16) {
            const __m512 mo = dec_coat_vb(qm + i, blo, bhi, am, nam, bm);
            const __m512 vo = dec_coat_vb(qv + i, blo, bhi, av, nav, bv);
            upd_v16(&s, p_, g_, m_out, v_out, &mo, &vo, i, PB, GB, SQ, 1);
        }
    }
#else
    {
        const dec_tab_t tm = dec_tables_v(tam, tbm), tv = dec_tables_v(tav, tbv);
        int64_t i = 0;
        for (; i + 64 <= n; i += 64) { /* 4 vectors at a time */
            __m512 mo[4], vo[4];
            for (int u = 0; u < 4; ++u) {
                mo[u] = dec_coat_v(qm + i + 16 * u, tm);
                vo[u] = dec_coat_v(qv + i + 16 * u, tv);
            }
            upd_v16(&s, p_, g_, m_out, v_out, mo, vo, i, PB, GB, SQ, 4);
        }
        for (; i < n; i += 16) {
            const __m512 mo = dec_coat_v(qm + i, tm), vo = dec_coat_v(qv + i, tv);
            upd_v16(&s, p_, g_, m_out, v_out, &mo, &vo, i, PB, GB, SQ, 1);
        }
    }
#endif
    red[0] = _mm512_reduce_max_epu32(s.amx);
    red[1] = _mm512_reduce_min_epu32(s.amn) + FLT_MIN_BITS;
    red[2] = _mm512_reduce_max_epu32(s.avx);
    red[3] = _mm512_reduce_min_epu32(s.avn) + FLT_MIN_BITS;
}
#endif


/* Prefetch (into L2) the parameter, gradient and codes of group gn of a task, if it exists.
   run_groups asks for the group CHUNK ahead while it requantizes the current chunk: the
   chunk's update loop then finds its memory streams in cache instead of stalling on them
   while the requantization, which touches no new memory, leaves the memory bus idle
   (measured on Zen 4, 1 thread: 222 -> 192 ns per 128-element group; same results). */
AI void prefetch_group(const char* pbase, const char* gbase, const uint8_t* mq, const uint8_t* vq,
                       int64_t gn, int64_t ngroups, int64_t cols, int64_t gs, int64_t psz,
                       int64_t gsz) {
    if (gn >= ngroups) return;
    const int64_t gc = (cols + gs - 1) / gs, r = gn / gc, c0 = (gn - r * gc) * gs;
    const int64_t off = r * cols + c0, n = (cols - c0 < gs) ? cols - c0 : gs;
    for (int64_t b = 0; b < n * psz; b += 64) __builtin_prefetch(pbase + off * psz + b, 1, 2);
    for (int64_t b = 0; b < n * gsz; b += 64) __builtin_prefetch(gbase + off * gsz + b, 0, 2);
    for (int64_t b = 0; b < gs; b += 64) {
        __builtin_prefetch(mq + gn * gs + b, 1, 2);
        __builtin_prefetch(vq + gn * gs + b, 1, 2);
    }
}
#ifndef LOG_CHUNK
#define LOG_CHUNK 4 /* the same for moment_format="log" (measured: 4 beats 1 and 16) */
#endif

/* A task is T_FIELDS int64 (pointers, sizes, flags: see T_* in _cpu_kernel.TASK_FIELDS).
   Groups lo..hi-1 of the task; mb / vb hold CHUNK * group_size floats. */
AI void run_groups(const int64_t* t, int64_t lo, int64_t hi, float* restrict mb,
                   float* restrict vb, const int PB, const int GB, const int E5, const int EX,
                   const int SQ, const int SRM, const int SRV) {
    const float F = E5 ? E5M2_MAX : E4M3_MAX;
    const float LOG2F = E5 ? E5M2_LOG2MAX : E4M3_LOG2MAX;
    const float STEPS = E5 ? E5M2_STEPS : E4M3_STEPS;
    const int64_t cols = t[T_COLS], gs = t[T_GROUP_SIZE];
    const int64_t gc = (cols + gs - 1) / gs;
    char* pbase = (char*)(intptr_t)t[T_P];
    const char* gbase = (const char*)(intptr_t)t[T_G];
    uint8_t* mq = (uint8_t*)(intptr_t)t[T_M_Q];
    float* ms = (float*)(intptr_t)t[T_M_S];
    float* mk = (float*)(intptr_t)t[T_M_K];
    uint8_t* vq = (uint8_t*)(intptr_t)t[T_V_Q];
    float* vs = (float*)(intptr_t)t[T_V_S];
    float* vk = (float*)(intptr_t)t[T_V_K];
    const float* hp = (const float*)(intptr_t)t[T_HP];
    const uint32_t key_m = (uint32_t)t[T_KEY_M], key_v = (uint32_t)t[T_KEY_V];
    const int64_t psz = PB ? 2 : 4, gsz = GB ? 2 : 4;
    const int64_t ngroups = t[T_ROWS] * gc;
    float ea[32], db[16]; /* coat.decode_log2_tables */
    if (EX) decode_log2_tables(ea, db, E5);
#if HAVE_AVX2_PATH
    /* every group of the task takes update_group_ex_v8's byte-plane loop: B from b_planes */
    const int BC = EX && !E5 && gs % 16 == 0 && cols % 16 == 0;
    b_cache_t* bcache = b_cache;
#elif HAVE_DEC_AVX512
    /* every group of the task takes update_group_ex_v: B from b_table16 */
    const int BC = EX && !E5 && gs % 16 == 0 && cols % 16 == 0;
    b_cache16_t* bcache16 = b_cache16;
#else
    const int BC = 0;
#endif
    for (int64_t g0 = lo; g0 < hi; g0 += CHUNK) {
        const int nb = (int)((hi - g0) < CHUNK ? (hi - g0) : CHUNK);
        float tam[CHUNK][DEC_NA], tbm[CHUNK][DEC_NB], tav[CHUNK][DEC_NA], tbv[CHUNK][DEC_NB];
        uint32_t mmax[CHUNK], mmin[CHUNK], vmax[CHUNK], vmin[CHUNK], stats[4 * CHUNK];
        int64_t nn[CHUNK];
        if (EX) {
            if (BC) {
                dequant_tables(ms + g0, mk + g0, tam, tbm, ea, db, nb, F, LOG2F, E5, 1);
                dequant_tables(vs + g0, vk + g0, tav, tbv, ea, db, nb, F, LOG2F, E5, 1);
            } else {
                dequant_tables(ms + g0, mk + g0, tam, tbm, ea, db, nb, F, LOG2F, E5, 0);
                dequant_tables(vs + g0, vk + g0, tav, tbv, ea, db, nb, F, LOG2F, E5, 0);
            }
        }
        for (int j = 0; j < nb; ++j) {
            const int64_t gi = g0 + j, r = gi / gc, c0 = (gi - r * gc) * gs;
            const int64_t off = r * cols + c0;
            int64_t n = cols - c0;
            n = (n < gs) ? n : gs;
            nn[j] = n;
            uint32_t* red = stats + 4 * j;
#if HAVE_DEC_AVX512
            if (EX && !E5 && n % 16 == 0) /* E4M3 codes with expansion: 16 lanes */
                update_group_ex_v(pbase + off * psz, gbase + off * gsz, mq + gi * gs,
                                  vq + gi * gs, mb + j * gs, vb + j * gs, tam[j],
                                  BC ? b_table16(bcache16, mk[gi], db) : tbm[j], tav[j],
                                  BC ? b_table16(bcache16 + 1, vk[gi], db) : tbv[j], hp, n, red,
                                  PB, GB, SQ);
            else
#endif
#if HAVE_AVX2_PATH
            if (EX && !E5 && n % 8 == 0) /* E4M3 codes with expansion: 8 lanes */
                update_group_ex_v8(pbase + off * psz, gbase + off * gsz, mq + gi * gs,
                                   vq + gi * gs, mb + j * gs, vb + j * gs, tam[j], tbm[j],
                                   tav[j], tbv[j], BC ? b_planes(bcache, mk[gi], db) : NULL,
                                   BC ? b_planes(bcache + 1, vk[gi], db) : NULL, hp, n, red, PB,
                                   GB, SQ);
            else
#endif
                update_group(pbase + off * psz, gbase + off * gsz, mq + gi * gs, vq + gi * gs,
                             mb + j * gs, vb + j * gs, ms[gi], vs[gi], tam[j], tbm[j], tav[j],
                             tbv[j], hp, n, red, PB, GB, E5, EX, SQ);
            mmax[j] = red[0]; mmin[j] = red[1]; vmax[j] = red[2]; vmin[j] = red[3];
        }
        float km[CHUNK], kv[CHUNK], lm[CHUNK], lv[CHUNK], am[CHUNK], av[CHUNK];
        quant_consts(mmax, mmin, ms + g0, EX ? mk + g0 : NULL, am, km, lm, nb, F, STEPS, EX);
        quant_consts(vmax, vmin, vs + g0, EX ? vk + g0 : NULL, av, kv, lv, nb, F, STEPS, EX);
        for (int j = 0; j < nb; ++j) {
            const uint32_t e0 = (uint32_t)((g0 + j) * gs); /* flat index of the group */
            prefetch_group(pbase, gbase, mq, vq, g0 + CHUNK + j, ngroups, cols, gs, psz, gsz);
            requant(mb + j * gs, mq + (g0 + j) * gs, nn[j], gs, EX ? km[j] : 0.0f,
                    EX ? lm[j] : 0.0f, am[j], b2f(mmin[j]), key_m + e0, E5, EX, SRM, 0);
            requant(vb + j * gs, vq + (g0 + j) * gs, nn[j], gs, EX ? kv[j] : 0.0f,
                    EX ? lv[j] : 0.0f, av[j], b2f(vmin[j]), key_v + e0, E5, EX, SRV, 1);
        }
    }
}

/* ---------------------------------------------------------------- moment_format="log"
   hf_fp8.numerics.log_moments, operation by operation: v as unsigned 8-bit codes uniform in
   Mitchell's log (the float's bit pattern), m as int8 absmax of m·2^-e (2^e ≈ sqrt(v̂), a
   power of two read from v̂'s exponent). No log2 / exp2: int32 and fp32 operations only. */

/* v̂ bit pattern of code c (0 when c == 0 or below FLT_MIN), from amax bits and 2^19/k.
   c is passed as an (integer-valued) float: (float)(c - 255) == c - 255.0f exactly.
   The offset is clamped at -(float)amax_bits (log_moments.offset_floor): below it the sum is
   within 64 units of 0, under FLT_MIN_BITS, and the element decodes to 0. */
AI int32_t log_v_bits(float c, int32_t amax_bits, float dv) {
    const float floor_ = -(float)amax_bits;
    float off = (c - (float)LOG_V_MAX) * dv;
    off = (off > floor_) ? off : floor_;
    int32_t b = amax_bits + (int32_t)rintf(off);
    return ((c != 0.0f) & (b >= (int32_t)FLT_MIN_BITS)) ? b : 0;
}

/* 2^e (inv = 0) or 2^-e (inv = 1), e = max(floor(c·slope + offset), -63): about sqrt(v̂)
   from v's code c (a float), slope = 2^-5/k and offset = L(amax)/2 - 255·slope. */
AI float log_m_scale(float c, float slope, float offset, const int inv) {
    float e = floorf(c * slope + offset);
    e = (e > -(float)LOG_E_MAX) ? e : -(float)LOG_E_MAX; /* max(e, -63): one vmaxps */
    int32_t ei = (int32_t)e;
    return b2f((uint32_t)(inv ? ((127 - ei) << 23) : ((ei + 127) << 23)));
}

/* Per-group offset of log_m_scale: L(amax)/2 from amax's bits, minus 255·slope. */
AI float log_m_offset(uint32_t amax_bits, float slope) {
    float half_log = (float)((int32_t)amax_bits - 0x3F800000) * LOG_INV_2_24;
    return half_log - slope * (float)LOG_V_MAX;
}

/* Stochastic rounding: top 24 bits of ((key + i)·WEYL) mod 2^32, as a float in [0, 1). */
AI float log_uniform(uint32_t key, uint32_t i) {
    uint32_t h = (key + i) * (uint32_t)LOG_WEYL;
    return (float)(int32_t)(h >> LOG_SR_SHIFT) * LOG_SR_UNIT;
}

#if HAVE_DEC_AVX512
/* moment_format="log" on 16 lanes (groups whose length is a multiple of 16): the same fp32 /
   int32 operations as update_group_log / requant_log_v / requant_log_m, in the same order,
   written with intrinsics so that each C ternary is the one instruction it means (a
   clamp `x > b ? x : b` is vmaxps(x, b), rintf / floorf are vrndscaleps, the cast of an
   integer-valued float is vcvttps2dq), and the stochastic-rounding counter (key + i)·WEYL
   advances by 16·WEYL per vector instead of a multiply per element. */
/* log_m_scale on 16 lanes: 2^e (inv = 0) or 2^-e (inv = 1) from the codes c (floats). */
AI __m512 log_m_scale_v(__m512 c, __m512 slope, __m512 offset, const int inv) {
    __m512 e = FLOOR_V(_mm512_add_ps(_mm512_mul_ps(c, slope), offset));
    e = _mm512_max_ps(e, _mm512_set1_ps(-(float)LOG_E_MAX));
    __m512i ei = _mm512_cvttps_epi32(e);
    __m512i b = inv ? _mm512_sub_epi32(_mm512_set1_epi32(127), ei)
                    : _mm512_add_epi32(ei, _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(b, 23));
}

AI void update_group_log_v(char* p_, const char* g_, const int8_t* restrict qm,
                           const uint8_t* restrict qv, float* restrict m_out,
                           float* restrict v_out, float sm, int32_t av, float dv, float slope,
                           float offset, const float* restrict hp, int64_t n,
                           uint32_t* restrict red, const int PB, const int GB) {
    const __m512 decay = _mm512_set1_ps(hp[HP_DECAY]), step_size = _mm512_set1_ps(hp[HP_STEP_SIZE]);
    const __m512 w1 = _mm512_set1_ps(hp[HP_ONE_MINUS_BETA1]), b2 = _mm512_set1_ps(hp[HP_BETA2]);
    const __m512 w2 = _mm512_set1_ps(hp[HP_ONE_MINUS_BETA2]), eps = _mm512_set1_ps(hp[HP_EPS]);
    const __m512 inv_bc2s = _mm512_set1_ps(hp[HP_INV_BC2]);
    const __m512 smv = _mm512_set1_ps(sm), dvv = _mm512_set1_ps(dv);
    const __m512 slv = _mm512_set1_ps(slope), ofv = _mm512_set1_ps(offset);
    const __m512 vmaxc = _mm512_set1_ps((float)LOG_V_MAX), floor_ = _mm512_set1_ps(-(float)av);
    const __m512i avv = _mm512_set1_epi32(av), fmin = _mm512_set1_epi32((int)FLT_MIN_BITS);
    const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF);
    float* restrict p32 = (float*)p_;
    uint16_t* restrict pbf = (uint16_t*)p_;
    const float* restrict g32 = (const float*)g_;
    const uint16_t* restrict gbf = (const uint16_t*)g_;
    __m512i avx = _mm512_setzero_si512(), avn = _mm512_set1_epi32((int)INF_BITS);
    for (int64_t i = 0; i < n; i += 16) {
        __m512i ci = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qv + i)));
        __m512 c = _mm512_cvtepi32_ps(ci);
        /* log_v_bits */
        __m512 off = _mm512_mul_ps(_mm512_sub_ps(c, vmaxc), dvv);
        off = _mm512_max_ps(off, floor_);
        __m512i b = _mm512_add_epi32(avv, _mm512_cvttps_epi32(RINT_V(off)));
        __mmask16 keep = _mm512_test_epi32_mask(ci, ci) & _mm512_cmpge_epi32_mask(b, fmin);
        __m512 vo = _mm512_castsi512_ps(_mm512_maskz_mov_epi32(keep, b));
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qm + i))));
        __m512 mo = _mm512_mul_ps(_mm512_mul_ps(q, smv), log_m_scale_v(c, slv, ofv, 0));
        __m512 g = GB ? bf16x16_to_f(gbf + i) : _mm512_loadu_ps(g32 + i);
        __m512 p = PB ? bf16x16_to_f(pbf + i) : _mm512_loadu_ps(p32 + i);
        __m512 mn = _mm512_add_ps(mo, _mm512_mul_ps(w1, _mm512_sub_ps(g, mo)));
        __m512 vn = _mm512_add_ps(_mm512_mul_ps(vo, b2), _mm512_mul_ps(_mm512_mul_ps(w2, g), g));
        __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vn), inv_bc2s), eps);
        __m512 pn = _mm512_sub_ps(_mm512_mul_ps(p, decay),
                                  _mm512_div_ps(_mm512_mul_ps(step_size, mn), den));
        if (PB) f_to_bf16x16(pbf + i, pn); else _mm512_storeu_ps(p32 + i, pn);
        _mm512_storeu_ps(m_out + i, mn);
        _mm512_storeu_ps(v_out + i, vn);
        __m512i vb = _mm512_and_si512(_mm512_castps_si512(vn), absm);
        /* vmaxps(x, acc): acc where x is NaN (NaN left out of the max, no extra instruction) */
        avx = _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(vb), _mm512_castsi512_ps(avx)));
        avn = _mm512_mask_min_epu32(avn, _mm512_cmpge_epu32_mask(vb, fmin), avn, vb);
    }
    red[0] = _mm512_reduce_max_epu32(avx);
    red[1] = _mm512_reduce_min_epu32(avn);
}

AI uint32_t requant_log_v_v(float* restrict mb, const float* restrict vb, uint8_t* restrict qv,
                            uint32_t vmax, float ev, float slope, float offset, int64_t n,
                            int64_t gs, uint32_t key_v, const int SRV) {
    const __m512 evv = _mm512_set1_ps(ev), slv = _mm512_set1_ps(slope), ofv = _mm512_set1_ps(offset);
    const __m512 vmaxc = _mm512_set1_ps((float)LOG_V_MAX), zero = _mm512_setzero_ps();
    const __m512i vmx = _mm512_set1_epi32((int32_t)vmax), fmin = _mm512_set1_epi32((int)FLT_MIN_BITS);
    const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), infb = _mm512_set1_epi32((int)INF_BITS);
    const __m512 unit = _mm512_set1_ps(LOG_SR_UNIT);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i dh = _mm512_set1_epi32((int)(16u * (uint32_t)LOG_WEYL));
    __m512i h = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)key_v), lanes),
                                   _mm512_set1_epi32((int)(uint32_t)LOG_WEYL));
    __m512i mmax = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
        __m512i a = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(vb + i)), absm);
        __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a, vmx)), evv),
                                 vmaxc);
        __m512 c;
        if (SRV) {
            __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, LOG_SR_SHIFT)), unit);
            c = FLOOR_V(_mm512_add_ps(t, u));
            h = _mm512_add_epi32(h, dh);
        } else {
            c = RINT_V(t);
        }
        c = _mm512_max_ps(c, zero);
        c = _mm512_min_ps(c, vmaxc);
        c = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(a, fmin) & _mm512_cmple_epi32_mask(a, infb),
                                c); /* zero and NaN: code 0 */
        _mm_storeu_si128((__m128i*)(qv + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(c)));
        __m512 mn = _mm512_mul_ps(_mm512_loadu_ps(mb + i), log_m_scale_v(c, slv, ofv, 1));
        _mm512_storeu_ps(mb + i, mn);
        __m512 ma = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(mn), absm));
        mmax = _mm512_castps_si512(_mm512_max_ps(ma, _mm512_castsi512_ps(mmax))); /* NaN: out */
    }
    for (int64_t i = n; i < gs; ++i) qv[i] = 0;
    return _mm512_reduce_max_epu32(mmax);
}

AI void requant_log_m_v(const float* restrict mb, int8_t* restrict qm, float inv, int valid,
                        int64_t n, int64_t gs, uint32_t key_m, const int SRM) {
    const __m512 invv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-(float)LOG_M_MAX);
    const __m512 hi = _mm512_set1_ps((float)LOG_M_MAX), unit = _mm512_set1_ps(LOG_SR_UNIT);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i dh = _mm512_set1_epi32((int)(16u * (uint32_t)LOG_WEYL));
    __m512i h = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)key_m), lanes),
                                   _mm512_set1_epi32((int)(uint32_t)LOG_WEYL));
    const __mmask16 keep = valid ? 0xFFFF : 0;
    for (int64_t i = 0; i < n; i += 16) {
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(mb + i), invv);
        __m512 q;
        if (SRM) {
            __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, LOG_SR_SHIFT)), unit);
            __m512i s = _mm512_and_si512(_mm512_castps_si512(t), sign);
            __m512 fl = FLOOR_V(_mm512_add_ps(_mm512_abs_ps(t), u));
            q = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(fl), s));
            h = _mm512_add_epi32(h, dh);
        } else {
            q = RINT_V(t);
        }
        /* clamps with q second: a NaN q stays NaN, vcvttps2dq makes it 0x80000000 and the
           truncation to 8 bits code 0 (the scalar loop's t == t test) */
        q = _mm512_max_ps(lo, q);
        q = _mm512_min_ps(hi, q);
        q = _mm512_maskz_mov_ps(keep, q);
        _mm_storeu_si128((__m128i*)(qm + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
    }
    for (int64_t i = n; i < gs; ++i) qm[i] = 0;
}
#endif

AI void update_group_log(char* p_, const char* g_, const int8_t* restrict qm,
                         const uint8_t* restrict qv, float* restrict m_out,
                         float* restrict v_out, float sm, int32_t av, float dv, float slope,
                         float offset, const float* restrict hp, int64_t n,
                         uint32_t* restrict red, const int PB, const int GB) {
    const float decay = hp[HP_DECAY], step_size = hp[HP_STEP_SIZE], w1 = hp[HP_ONE_MINUS_BETA1];
    const float b2 = hp[HP_BETA2], w2 = hp[HP_ONE_MINUS_BETA2];
    const float eps = hp[HP_EPS], inv_bc2s = hp[HP_INV_BC2];
    float* restrict p32 = (float*)p_;
    uint16_t* restrict pbf = (uint16_t*)p_;
    const float* restrict g32 = (const float*)g_;
    const uint16_t* restrict gbf = (const uint16_t*)g_;
#if HAVE_DEC_AVX512
    if (n % 16 == 0) {
        update_group_log_v(p_, g_, qm, qv, m_out, v_out, sm, av, dv, slope, offset, hp, n, red,
                           PB, GB);
        return;
    }
#endif
    uint32_t avx = 0u, avn = INF_BITS;
    for (uint32_t i = 0; i < (uint32_t)n; ++i) {
        float c = (float)qv[i];
        float vo = b2f((uint32_t)log_v_bits(c, av, dv));
        float mo = ((float)qm[i] * sm) * log_m_scale(c, slope, offset, 0);
        float g = GB ? bf16_to_f(gbf[i]) : g32[i];
        float p = PB ? bf16_to_f(pbf[i]) : p32[i];
        float mn = mo + w1 * (g - mo);
        float vn = vo * b2 + w2 * g * g;
        float rt = sqrtf(vn);
        float den = rt * inv_bc2s + eps;
        float pn = p * decay - step_size * mn / den;
        if (PB) pbf[i] = f_to_bf16(pn); else p32[i] = pn;
        m_out[i] = mn;
        v_out[i] = vn;
        uint32_t b = f2b(vn) & 0x7FFFFFFFu;
        uint32_t bf = b & not_nan(b); /* NaN: not the maximum */
        avx = (bf > avx) ? bf : avx;
        uint32_t bn = (b >= FLT_MIN_BITS) ? b : INF_BITS;
        avn = (bn < avn) ? bn : avn;
    }
    red[0] = avx; red[1] = avn;
}

AI float log_v_exponent(uint32_t vmax, uint32_t vmin) {
    int valid = vmax >= FLT_MIN_BITS;
    uint32_t lo = (vmin < vmax) ? vmin : vmax;
    float lr = (float)(int32_t)(vmax - lo) * LOG_INV_2_23;
    int ex = valid & (lr > 0.0f);
    float k = ex ? floorf(LOG_V_RANGE_STEPS / (ex ? lr : 1.0f)) * INV_STEPS : 1.0f;
    k = (k < K_MIN) ? K_MIN : k;
    k = (k > K_MAX) ? K_MAX : k;
    return k;
}

/* Requantize v of one group (codes from its amax bits and k) and, in the same loop, m·2^-e
   from the new codes (in place in mb); returns the bit pattern of max |m·2^-e| (NaN left
   out). A NaN v gets code 0. */
AI uint32_t requant_log_v(float* restrict mb, const float* restrict vb, uint8_t* restrict qv,
                          uint32_t vmax, float ev, float slope, float offset, int64_t n,
                          int64_t gs, uint32_t key_v, const int SRV) {
#if HAVE_DEC_AVX512
    if (n % 16 == 0)
        return requant_log_v_v(mb, vb, qv, vmax, ev, slope, offset, n, gs, key_v, SRV);
#endif
    uint32_t mmax = 0u;
    for (uint32_t i = 0; i < (uint32_t)n; ++i) {
        float x = vb[i];
        int32_t a = (int32_t)(f2b(x) & 0x7FFFFFFFu);
        float t = (float)(a - (int32_t)vmax) * ev + (float)LOG_V_MAX;
        float c = SRV ? floorf(t + log_uniform(key_v, i)) : rintf(t);
        c = (c > 0.0f) ? c : 0.0f; /* clamps written as max / min */
        c = (c < (float)LOG_V_MAX) ? c : (float)LOG_V_MAX;
        c = ((a >= (int32_t)FLT_MIN_BITS) & (a <= (int32_t)INF_BITS)) ? c : 0.0f; /* 0, NaN */
        qv[i] = (uint8_t)(int32_t)c;
        float mn = mb[i] * log_m_scale(c, slope, offset, 1);
        mb[i] = mn;
        uint32_t b = f2b(mn) & 0x7FFFFFFFu;
        b &= not_nan(b); /* NaN: not the maximum */
        mmax = (b > mmax) ? b : mmax;
    }
    for (uint32_t i = (uint32_t)n; i < (uint32_t)gs; ++i) qv[i] = 0;
    return mmax;
}

/* int8 codes of m·2^-e (mb) with the group's 127 / amax (0 codes when invalid). */
AI void requant_log_m(const float* restrict mb, int8_t* restrict qm, float inv, int valid,
                      int64_t n, int64_t gs, uint32_t key_m, const int SRM) {
#if HAVE_DEC_AVX512
    if (n % 16 == 0) {
        requant_log_m_v(mb, qm, inv, valid, n, gs, key_m, SRM);
        return;
    }
#endif
    for (uint32_t i = 0; i < (uint32_t)n; ++i) {
        float t = mb[i] * inv;
        float q = SRM ? copysignf(floorf(fabsf(t) + log_uniform(key_m, i)), t) : rintf(t);
        q = (q > -(float)LOG_M_MAX) ? q : -(float)LOG_M_MAX;
        q = (q < (float)LOG_M_MAX) ? q : (float)LOG_M_MAX;
        qm[i] = (int8_t)(int32_t)((valid & (t == t)) ? q : 0.0f); /* NaN: code 0 */
    }
    for (uint32_t i = (uint32_t)n; i < (uint32_t)gs; ++i) qm[i] = 0;
}

/* The LOG_CHUNK (or fewer: nb) groups g0.. of a task: the per-group scalars (k, 2^19/k,
   127/amax: the divisions) are computed across the chunk's groups, where they vectorize.
   FULL: rows of whole 128-element groups (the default group size), so that the group of gi
   starts at element gi·128 and every loop has a constant trip count (called with nb ==
   LOG_CHUNK too: the chunk's own loops are then straight-line vector code). mb / vb hold
   LOG_CHUNK * group_size floats. */
AI void log_chunk(const int64_t* t, int64_t g0, const int nb, float* restrict mb,
                  float* restrict vb, const int FULL, const int PB, const int GB, const int SRM,
                  const int SRV) {
    const int64_t cols = t[T_COLS], gs = FULL ? 128 : t[T_GROUP_SIZE];
    const int64_t gc = (cols + gs - 1) / gs;
    char* pbase = (char*)(intptr_t)t[T_P];
    const char* gbase = (const char*)(intptr_t)t[T_G];
    int8_t* mq = (int8_t*)(intptr_t)t[T_M_Q];
    float* ms = (float*)(intptr_t)t[T_M_S];
    uint8_t* vq = (uint8_t*)(intptr_t)t[T_V_Q];
    float* vs = (float*)(intptr_t)t[T_V_S];
    float* vk = (float*)(intptr_t)t[T_V_K];
    const float* hp = (const float*)(intptr_t)t[T_HP];
    const uint32_t key_m = (uint32_t)t[T_KEY_M], key_v = (uint32_t)t[T_KEY_V];
    const int64_t psz = PB ? 2 : 4, gsz = GB ? 2 : 4;
    float dv[LOG_CHUNK], ev[LOG_CHUNK], kk[LOG_CHUNK], inv[LOG_CHUNK], am[LOG_CHUNK];
    float slope[LOG_CHUNK], hl[LOG_CHUNK];
    uint32_t vmax[LOG_CHUNK], vmin[LOG_CHUNK], mmax[LOG_CHUNK];
    int64_t nn[LOG_CHUNK];
    for (int j = 0; j < nb; ++j) {
        dv[j] = LOG_V_DEC / vk[g0 + j];
        slope[j] = LOG_E_SLOPE / vk[g0 + j];
        hl[j] = log_m_offset(f2b(vs[g0 + j]), slope[j]);
    }
    for (int j = 0; j < nb; ++j) {
        const int64_t gi = g0 + j;
        int64_t off = gi * 128, n = 128;
        if (!FULL) { /* the group's row and column */
            const int64_t r = gi / gc, c0 = (gi - r * gc) * gs;
            off = r * cols + c0;
            n = (cols - c0 < gs) ? cols - c0 : gs;
        }
        nn[j] = n;
        uint32_t red[2];
        update_group_log(pbase + off * psz, gbase + off * gsz, mq + gi * gs, vq + gi * gs,
                         mb + j * gs, vb + j * gs, ms[gi], (int32_t)f2b(vs[gi]), dv[j],
                         slope[j], hl[j], hp, FULL ? 128 : n, red, PB, GB);
        vmax[j] = (red[0] == INF_BITS) ? FLT_MAX_BITS : red[0]; /* overflowed v: saturate */
        vmin[j] = red[1];
    }
    for (int j = 0; j < nb; ++j) {
        kk[j] = log_v_exponent(vmax[j], vmin[j]);
        ev[j] = kk[j] * LOG_V_ENC;
        slope[j] = LOG_E_SLOPE / kk[j];
        hl[j] = log_m_offset((vmax[j] >= FLT_MIN_BITS) ? vmax[j] : 0u, slope[j]);
        vs[g0 + j] = b2f((vmax[j] >= FLT_MIN_BITS) ? vmax[j] : 0u);
        vk[g0 + j] = kk[j];
    }
    for (int j = 0; j < nb; ++j) {
        const uint32_t e0 = (uint32_t)((g0 + j) * gs); /* flat index of the group */
        mmax[j] = requant_log_v(mb + j * gs, vb + j * gs, vq + (g0 + j) * gs, vmax[j], ev[j],
                                slope[j], hl[j], FULL ? 128 : nn[j], gs, key_v + e0, SRV);
    }
    for (int j = 0; j < nb; ++j) {
        am[j] = b2f(mmax[j]);
        am[j] = (am[j] < LOG_M_SAT) ? am[j] : LOG_M_SAT; /* inf / huge m·2^-e saturates */
        int valid = am[j] >= LOG_M_MIN;
        inv[j] = (float)LOG_M_MAX / (valid ? am[j] : 1.0f);
        ms[g0 + j] = valid ? am[j] / (float)LOG_M_MAX : 0.0f;
    }
    for (int j = 0; j < nb; ++j) {
        const uint32_t e0 = (uint32_t)((g0 + j) * gs);
        const int valid = am[j] >= LOG_M_MIN;
        requant_log_m(mb + j * gs, mq + (g0 + j) * gs, inv[j], valid, FULL ? 128 : nn[j], gs,
                      key_m + e0, SRM);
    }
}

/* Groups lo..hi-1 of a task, LOG_CHUNK at a time. */
AI void run_groups_log(const int64_t* t, int64_t lo, int64_t hi, float* restrict mb,
                       float* restrict vb, const int PB, const int GB, const int SRM,
                       const int SRV) {
    const int full = t[T_GROUP_SIZE] == 128 && t[T_COLS] % 128 == 0;
    for (int64_t g0 = lo; g0 < hi; g0 += LOG_CHUNK) {
        const int nb = (int)((hi - g0) < LOG_CHUNK ? (hi - g0) : LOG_CHUNK);
        if (full && nb == LOG_CHUNK)
            log_chunk(t, g0, LOG_CHUNK, mb, vb, 1, PB, GB, SRM, SRV);
        else if (full)
            log_chunk(t, g0, nb, mb, vb, 1, PB, GB, SRM, SRV);
        else
            log_chunk(t, g0, nb, mb, vb, 0, PB, GB, SRM, SRV);
    }
}

/* One variant per library: VARIANT is a combination of the FLAG_* bits. */
static int dispatch(const int64_t* t, int64_t lo, int64_t hi, float* mb, float* vb) {
    if (VARIANT & FLAG_LOG) {
        run_groups_log(t, lo, hi, mb, vb, (VARIANT & FLAG_P_BF16) != 0,
                       (VARIANT & FLAG_G_BF16) != 0, (VARIANT & FLAG_SR_M) != 0,
                       (VARIANT & FLAG_SR_V) != 0);
        return 0;
    }
    run_groups(t, lo, hi, mb, vb, (VARIANT & FLAG_P_BF16) != 0, (VARIANT & FLAG_G_BF16) != 0,
               (VARIANT & FLAG_E5M2) != 0, (VARIANT & FLAG_EXPAND) != 0,
               (VARIANT & FLAG_SQRT_V) != 0, (VARIANT & FLAG_SR_M) != 0,
               (VARIANT & FLAG_SR_V) != 0);
    return 0;
}

static int64_t task_groups(const int64_t* t) {
    return t[T_ROWS] * ((t[T_COLS] + t[T_GROUP_SIZE] - 1) / t[T_GROUP_SIZE]);
}

/* Sizes are never trusted: every pointer comes with the element count of its tensor, and a
   task runs only when each count is exactly what rows, cols and group_size address.
   0: valid; 2: another variant; 3: bad sizes; 4: a null pointer for a non-empty tensor. */
static int check_task(const int64_t* t) {
    const int64_t rows = t[T_ROWS], cols = t[T_COLS], gs = t[T_GROUP_SIZE];
    if (t[T_FLAGS] != VARIANT) return 2;
    if (rows < 0 || cols < 1 || gs < 1 || gs > 65536) return 3;
    const int64_t gc = (cols + gs - 1) / gs;
    if (rows > 0 && (cols > INT64_MAX / rows || gc > INT64_MAX / gs / rows)) return 3;
    const int64_t n = rows * cols, nq = rows * gc * gs, ns = rows * gc;
    const int ex = (VARIANT & FLAG_EXPAND) != 0, lg = (VARIANT & FLAG_LOG) != 0;
    if (lg && (VARIANT & (FLAG_EXPAND | FLAG_E5M2 | FLAG_SQRT_V))) return 2;
    if (lg && (t[T_M_K_N] != 0 || t[T_V_K_N] != ns)) return 3;
    if (n > 0 && lg && !t[T_V_K]) return 4;
    if (t[T_P_N] != n || t[T_G_N] != n || t[T_M_Q_N] != nq || t[T_V_Q_N] != nq) return 3;
    if (t[T_M_S_N] != ns || t[T_V_S_N] != ns || t[T_HP_N] != HP_FIELDS) return 3;
    if (ex && (t[T_M_K_N] != ns || t[T_V_K_N] != ns)) return 3;
    if (!t[T_HP]) return 4;
    if (n > 0 && (!t[T_P] || !t[T_G] || !t[T_M_Q] || !t[T_M_S] || !t[T_V_Q] || !t[T_V_S]))
        return 4;
    if (n > 0 && ex && (!t[T_M_K] || !t[T_V_K])) return 4;
    return 0;
}

/* Thread i owns the i-th contiguous share of the groups and takes them SPAN at a time from
   the share's counter; a thread done with its share takes from the others' counters (work
   stealing), so that a thread slowed by another process on its core (a shared machine, or
   torch's OpenMP threads still spin-waiting after the previous parallel region) does not hold
   the step back, while each thread still streams through one contiguous range of memory.
   Every group is independent and its random bits come from its element index, so the split
   never changes results. */
#ifndef SPAN
#define SPAN 64 /* groups per grab: 8192 elements at the default group size */
#endif

#ifndef SCRATCH_ALLOC /* the scratch allocator: replaced only by the out-of-memory test */
#define SCRATCH_ALLOC malloc
#endif

typedef struct {
    const int64_t* tasks;
    int64_t ntasks, maxgs, nt;
    int64_t next[MAX_THREADS]; /* the first group of share i not yet taken (atomic) */
    int64_t stop[MAX_THREADS]; /* the end of share i */
} shared_t;

typedef struct {
    shared_t* sh;
    float* buf; /* scratch, allocated before any thread starts: 64-byte aligned in raw */
    void* raw;
    int64_t id;
    int rc;
} work_t;

static void* worker(void* arg) {
    work_t* w = (work_t*)arg;
    shared_t* sh = w->sh;
    float* buf = w->buf;
    for (int64_t r = 0; r < sh->nt; ++r) {
        const int64_t s = (w->id + r) % sh->nt; /* its own share first, then the others' */
        int64_t k = 0, base = 0; /* grabs from one share only increase: scan the tasks forward */
        for (;;) {
            const int64_t start = __atomic_fetch_add(&sh->next[s], SPAN, __ATOMIC_RELAXED);
            if (start >= sh->stop[s]) break;
            const int64_t stop = start + SPAN < sh->stop[s] ? start + SPAN : sh->stop[s];
            while (k < sh->ntasks && base + task_groups(sh->tasks + T_FIELDS * k) <= start) {
                base += task_groups(sh->tasks + T_FIELDS * k);
                ++k;
            }
            for (int64_t j = k, b = base; j < sh->ntasks && b < stop; ++j) {
                const int64_t* t = sh->tasks + T_FIELDS * j;
                const int64_t ng = task_groups(t);
                const int64_t lo = (start > b ? start : b) - b;
                const int64_t hi = (stop < b + ng ? stop : b + ng) - b;
                if (lo < hi) {
                    int rc = dispatch(t, lo, hi, buf, buf + CHUNK * sh->maxgs);
                    if (rc) w->rc = rc;
                }
                b += ng;
            }
        }
    }
    return NULL;
}

int adamw_fp8_step(int64_t ntasks, const int64_t* tasks, int64_t nthreads) {
    int64_t total = 0, maxgs = 1;
    for (int64_t k = 0; k < ntasks; ++k) {
        const int64_t* t = tasks + T_FIELDS * k;
        int rc = check_task(t);
        if (rc) return rc; /* nothing is touched unless every task is valid */
        total += task_groups(t);
        maxgs = t[T_GROUP_SIZE] > maxgs ? t[T_GROUP_SIZE] : maxgs;
    }
    int64_t nt = nthreads < 1 ? 1 : nthreads;
    nt = nt > MAX_THREADS ? MAX_THREADS : nt;
    int64_t useful = total / 256 + 1; /* at least 256 groups per thread */
    nt = nt > useful ? useful : nt;
    shared_t sh;
    sh.tasks = tasks; sh.ntasks = ntasks; sh.maxgs = maxgs; sh.nt = nt;
    work_t w[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    int started[MAX_THREADS];
    for (int64_t i = 0; i < nt; ++i) {
        sh.next[i] = total * i / nt;
        sh.stop[i] = total * (i + 1) / nt;
        w[i].sh = &sh; w[i].id = i; w[i].rc = 0;
        started[i] = 0;
        /* every thread's scratch first, so that out of memory touches nothing: allocated in
           the workers, a failed thread's share was stolen by the others and the step applied,
           then reported as failed (a caller retrying would apply it twice) */
        /* aligned to a cache line (malloc gives 16 bytes): the loops' 64-byte loads and
           stores of the scratch rows then never straddle two lines (0.98x the step's time) */
        w[i].raw = SCRATCH_ALLOC(2 * CHUNK * maxgs * sizeof(float) + 64);
        if (!w[i].raw) {
            for (int64_t j = 0; j < i; ++j) free(w[j].raw);
            return 1;
        }
        w[i].buf = (float*)(((uintptr_t)w[i].raw + 63) & ~(uintptr_t)63);
    }
    if (nt == 1) {
        worker(&w[0]);
    } else {
#if defined(USE_OMP)
        /* Built with -fopenmp only where torch's own libgomp is loaded (_cpu_kernel.py): the
           parallel region runs on torch's thread pool, whose threads are still spin-waiting
           after torch's last parallel region, instead of new threads competing with them. */
#pragma omp parallel num_threads(nt)
        worker(&w[omp_get_thread_num()]);
#else
        for (int64_t i = 1; i < nt; ++i)
            started[i] = pthread_create(&th[i], NULL, worker, &w[i]) == 0;
        worker(&w[0]); /* the calling thread works too (and alone if no thread started) */
#endif
    }
    int rc = w[0].rc;
    for (int64_t i = 1; i < nt; ++i) {
        if (started[i]) pthread_join(th[i], NULL);
        if (w[i].rc) rc = w[i].rc;
    }
    for (int64_t i = 0; i < nt; ++i) free(w[i].raw);
    return rc;
}
