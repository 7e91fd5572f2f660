/* Test driver for hf_fp8/kernels/csrc/fp8_gemv.c on machines Python cannot reach (aarch64
 * under qemu): fixed inputs through every entry point, results printed one per line
 * (exact kernels as hex bits, the GEMV as %.9g). tests/kernels/test_cpu_kernel_cross.py
 * builds it per code path and compares the outputs. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int fp8_gemv(const float *a, int64_t M, int64_t K, const uint8_t *w, int64_t N,
             const float *ws, int64_t wgran, int64_t bn, int64_t bk, const float *as,
             int64_t agran, const float *bias, void *out, int64_t out_kind, int64_t fmt,
             int64_t a_kind, int64_t nthreads);
int fp8_decode(const uint8_t *w, int64_t rows, int64_t K, int64_t row0, const float *ws,
               int64_t wgran, int64_t bn, int64_t bk, void *out, int64_t out_kind, int64_t fmt,
               int64_t nthreads);
int fp8_quant_act(const void *x, int64_t x_bf16, int64_t M, int64_t K, int64_t gran,
                  int64_t bk, int64_t fmt, float *scale, int64_t given, void *out,
                  int64_t out_kind, int64_t post, float floor, int64_t nthreads);

static uint32_t state = 12345u;
static uint32_t next(void) {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
}
static float uniform(void) { return (float)next() / 16777216.0f * 2.0f - 1.0f; }
static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

int main(void) {
    enum { K = 203, N = 37, QM = 5, QK = 150 };
    static uint8_t codes[3 * 256], w[N * K];
    static float f32[3 * 256], a[16 * K], out[16 * N], ws[N], as[16], bias[N], bs[3 * 7];
    static uint16_t b16[3 * 256];
    for (int i = 0; i < 3 * 256; ++i) codes[i] = (uint8_t)i;
    for (int fmt = 0; fmt < 2; ++fmt) {
        float rs[3] = {0.37f, 1.5f, 3e-3f};
        if (fp8_decode(codes, 3, 256, 0, NULL, 1, 1, 1, f32, 0, fmt, 2)) return 1;
        for (int i = 0; i < 3 * 256; ++i) printf("dec %d %08x\n", fmt, bits(f32[i]));
        if (fp8_decode(codes, 3, 256, 0, rs, 1, 1, 1, b16, 1, fmt, 2)) return 1;
        for (int i = 0; i < 3 * 256; ++i) printf("decb %d %04x\n", fmt, b16[i]);
    }
    for (int i = 0; i < N * K; ++i) {
        uint8_t c = (uint8_t)next();
        w[i] = (c & 0x7f) >= 0x7c ? 1 : c; /* finite in both formats */
    }
    for (int i = 0; i < 16 * K; ++i) a[i] = uniform() * 4.0f;
    for (int i = 0; i < N; ++i) ws[i] = 1e-3f + 1e-3f * (uniform() + 1.0f), bias[i] = uniform();
    for (int i = 0; i < 16; ++i) as[i] = 0.01f * (uniform() + 1.5f);
    for (int i = 0; i < 3 * 7; ++i) bs[i] = 1e-3f * (uniform() + 1.5f);
    int ms[4] = {1, 3, 8, 16};
    for (int fmt = 0; fmt < 2; ++fmt)
        for (int gran = 0; gran < 3; ++gran)
            for (int mi = 0; mi < 4; ++mi) {
                const float *scale = gran == 2 ? bs : ws;
                if (fp8_gemv(a, ms[mi], K, w, N, scale, gran, 16, 32, as, 2, bias, out, 0, fmt, 0,
                             2))
                    return 2;
                for (int i = 0; i < ms[mi] * N; ++i)
                    printf("gemv %d %d %d %.9g\n", fmt, gran, ms[mi], out[i]);
            }
    static float x[QM * QK], q[QM * QK], sc[QM * 5];
    for (int i = 0; i < QM * QK; ++i) x[i] = uniform() * (float)(1 << (next() % 20)) * 1e-3f;
    x[7] = 1.0f / 0.0f, x[9] = 0.0f / 0.0f, x[11] = 1e30f;
    for (int i = 2 * QK; i < 3 * QK; ++i) x[i] = (float)(i % 40) * 0x1p-10f;
    for (int fmt = 0; fmt < 2; ++fmt)
        for (int gran = 0; gran < 3; ++gran)
            for (int post = 0; post < 2; ++post) {
                if (fp8_quant_act(x, 0, QM, QK, gran, 32, fmt, sc, 0, q, 0, post,
                                  1.17549435e-38f, 2))
                    return 3;
                for (int i = 0; i < QM * QK; ++i) printf("q %d %d %d %08x\n", fmt, gran, post, bits(q[i]));
                int ns = gran == 0 ? 1 : gran == 1 ? QM : QM * 5;
                for (int i = 0; i < ns; ++i) printf("s %d %d %08x\n", fmt, gran, bits(sc[i]));
            }
    return 0;
}
