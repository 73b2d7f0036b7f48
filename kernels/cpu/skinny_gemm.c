/* y = x W^T for a few rows of x (decode of a handful of sequences), fp32, AVX-512.
 *
 * With M <= 8 rows the product is bound by streaming W from memory, but the BLAS's general GEMM reads
 * W at 7-10 GB/s here (it packs W into panels first, which pays off only for many rows). This kernel reads
 * each row of W once, straight from the weights, for all M rows of x at once (x stays in L1), which
 * streams W at close to the memory bandwidth. Threads split the rows of W.
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

static inline __attribute__((always_inline)) void gemm_m(const float *x, int64_t x_stride, const float *w,
                                                          int64_t N, int64_t K, float *y, int64_t y_stride,
                                                          const int M) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += 2) {
        const float *w0 = w + n * K, *w1 = n + 1 < N ? w0 + K : w0;  /* an odd last row is done twice */
        if (n + 1 < N) {
            two_rows(x, x_stride, w0, w1, K, y, y_stride, n, M);
        } else {
            float tmp[16];
            two_rows(x, x_stride, w0, w1, K, tmp, 2, 0, M);
            for (int m = 0; m < M; ++m) y[m * y_stride + n] = tmp[2 * m];
        }
    }
}
#endif

/* Returns 0 when done, -1 when this shape is not handled (the caller uses the BLAS): needs AVX-512,
 * 1 <= M <= 8 and K a multiple of 16; W is [N, K] dense, x rows x_stride floats apart, y [M, N] rows
 * y_stride apart. */
int lbd_skinny_gemm_f32(const float *x, int64_t x_stride, const float *w, int64_t N, int64_t K, float *y,
                        int64_t y_stride, int64_t M) {
#if defined(__AVX512F__)
    if (K % 16 != 0) return -1;
    switch (M) {
        case 1: gemm_m(x, x_stride, w, N, K, y, y_stride, 1); return 0;
        case 2: gemm_m(x, x_stride, w, N, K, y, y_stride, 2); return 0;
        case 3: gemm_m(x, x_stride, w, N, K, y, y_stride, 3); return 0;
        case 4: gemm_m(x, x_stride, w, N, K, y, y_stride, 4); return 0;
        case 5: gemm_m(x, x_stride, w, N, K, y, y_stride, 5); return 0;
        case 6: gemm_m(x, x_stride, w, N, K, y, y_stride, 6); return 0;
        case 7: gemm_m(x, x_stride, w, N, K, y, y_stride, 7); return 0;
        case 8: gemm_m(x, x_stride, w, N, K, y, y_stride, 8); return 0;
        default: return -1;
    }
#else
    (void)x; (void)x_stride; (void)w; (void)N; (void)K; (void)y; (void)y_stride; (void)M;
    return -1;
#endif
}
