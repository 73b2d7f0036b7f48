/* y = x W^T for a few rows of x (decode steps of up to a few dozen sequences), fp32, AVX-512.
 *
 * With few rows the product is bound by streaming W from memory, but the BLAS's general GEMM reads W at
 * 7-10 GB/s here (it packs W into panels first, which pays off only for many rows). This kernel reads each
 * row of W once, straight from the weights, for all rows of x (8 at a time, from L1/L2), ~20 GB/s with 2
 * threads. Measured against MKL on SmolLM2's 30 layers: 1.7x at 9 rows, 1.1x at 32, 0.95x at 64, hence
 * the 32-row limit in kernels.cpu. Threads split the rows of W.
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void two_rows(const float *x, int64_t x_stride, const float *w0,
                                                            const float *w1, int64_t K, float *y,
                                                            int64_t y_stride, int64_t n, const int M) {
    __m512 a0[8], a1[8];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
        for (int m = 0; m < M; ++m) {
            const __m512 xv = _mm512_loadu_ps(x + m * x_stride + k);
            a0[m] = _mm512_fmadd_ps(xv, v0, a0[m]);
            a1[m] = _mm512_fmadd_ps(xv, v1, a1[m]);
        }
    }
    for (int m = 0; m < M; ++m) {
        y[m * y_stride + n] = _mm512_reduce_add_ps(a0[m]);
        y[m * y_stride + n + 1] = _mm512_reduce_add_ps(a1[m]);
    }
}

/* All M rows of x against rows n and n+1 of W, 8 rows of x at a time: W's two rows are read from memory
 * once and then from L1, x (M x K, at most 64 x K) stays in L2. */
static void row_pair(const float *x, int64_t x_stride, const float *w0, const float *w1, int64_t K, float *y,
                     int64_t y_stride, int64_t n, int64_t M) {
    for (int64_t g = 0; g < M; g += 8) {
        const float *xg = x + g * x_stride;
        float *yg = y + g * y_stride;
        switch (M - g < 8 ? M - g : 8) {
            case 1: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 1); break;
            case 2: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 2); break;
            case 3: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 3); break;
            case 4: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 4); break;
            case 5: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 5); break;
            case 6: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 6); break;
            case 7: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 7); break;
            default: two_rows(xg, x_stride, w0, w1, K, yg, y_stride, n, 8); break;
        }
    }
}
#endif

/* Returns 0 when done, -1 when this shape is not handled (the caller uses the BLAS): needs AVX-512,
 * 1 <= M <= 64 and K a multiple of 16; W is [N, K] dense, x rows x_stride floats apart, y [M, N] rows
 * y_stride apart. Threads split the rows of W. */
int lbd_skinny_gemm_f32(const float *x, int64_t x_stride, const float *w, int64_t N, int64_t K, float *y,
                        int64_t y_stride, int64_t M) {
#if defined(__AVX512F__)
    if (K % 16 != 0 || M < 1 || M > 64) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += 2) {
        const float *w0 = w + n * K;
        if (n + 1 < N) {
            row_pair(x, x_stride, w0, w0 + K, K, y, y_stride, n, M);
        } else {  /* an odd last row: computed twice into a scratch pair, one copy kept */
            float tmp[128];
            row_pair(x, x_stride, w0, w0, K, tmp, 2, 0, M);
            for (int64_t m = 0; m < M; ++m) y[m * y_stride + n] = tmp[2 * m];
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)w; (void)N; (void)K; (void)y; (void)y_stride; (void)M;
    return -1;
#endif
}
