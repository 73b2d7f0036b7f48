/* y = x W^T (+ bias) over weights packed once at load: fp32 and bf16 (fp32 sums), with an AVX-512 BF16, an
 * AVX-512F, an AVX2 and a portable path (the build's level picks one; build.py).
 *
 * Why: at decode sizes (8..64 rows of x) the BLAS's fp32 GEMM packs W into panels on every call and reached
 * ~100 GFLOP/s here, about half of this CPU's FMA peak. Packing W once at load (the layout the inner loop
 * reads) leaves only the arithmetic: with AVX-512 a 12 x 32 tile of y lives in 24 vector registers while the
 * loop walks K, loading two vectors of the W panel and broadcasting one x value per row per step (FMA-bound,
 * not load-bound); AVX2's 16 registers hold a 6 x 16 tile (each panel taken as two halves). Threads split the
 * panels of W; each walks every row of x (x stays in its L2), so W is read from memory once per call. The
 * portable loops (a row of y at a time, its 32 sums in an array the compiler vectorises) are there so every
 * level computes every shape; lbd_packed_gemm_support() names only the paths worth packing for.
 *
 * Layouts (the same at every level, so weights packed by one build run in another). fp32: panel p holds output
 * columns [32p, 32p + 32) as K rows of 32 floats: P[p][k][j] = W[32p + j][k] (columns past N are zero). bf16:
 * the same panels, with k taken in pairs as VDPBF16PS wants them: P[p][k/2][j][k%2] (K rounded up to even,
 * zero-padded). x [M, K] rows x_stride elements apart, y [M, N] rows y_stride apart, both in the weights'
 * dtype. The entry points return 0.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "pool.h"

#define NR 32 /* output columns per panel: two 16-float vectors */
#define MR 12 /* rows of x per register tile: 2 x 12 accumulators + 2 W vectors + 1 broadcast <= 32 */
#define MR_AVX2 6 /* AVX2: 2 x 6 accumulators + 2 W vectors + 1 broadcast <= 16 */
#define X_BLOCK_BYTES (384 << 10) /* rows of x taken per pass over the panels: this much stays in L2 */

/* 1: fp32, 2: bf16 have a vector kernel here that beats torch's GEMM (the caller packs only for those; the
 * portable loops run the other cases correctly, for tests, but slower than the BLAS). */
int lbd_packed_gemm_support(void) {
    int s = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    s |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    s |= 2;
#endif
    return s;
}

int64_t lbd_packed_size(int64_t N, int64_t K, int bf16) {
    const int64_t panels = (N + NR - 1) / NR;
    return panels * NR * (bf16 ? (K + 1) / 2 * 2 : K);
}

struct pack_job {
    const void *w;
    int64_t w_stride, N, K;
    void *out;
};

static void pack_f32_panel(void *arg, int64_t p) {
    const struct pack_job *j = arg;
    const float *w = j->w;
    float *dst = (float *)j->out + p * j->K * NR;
    for (int64_t c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        for (int64_t k = 0; k < j->K; ++k) dst[k * NR + c] = n < j->N ? w[n * j->w_stride + k] : 0.0f;
    }
}

static void pack_bf16_panel(void *arg, int64_t p) {
    const struct pack_job *j = arg;
    const uint16_t *w = j->w;
    const int64_t K = j->K, K2 = (K + 1) / 2 * 2;
    uint16_t *dst = (uint16_t *)j->out + p * K2 * NR;
    for (int64_t c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        for (int64_t k = 0; k < K2; ++k)
            dst[(k / 2) * 2 * NR + c * 2 + (k % 2)] = (n < j->N && k < K) ? w[n * j->w_stride + k] : 0;
    }
}

void lbd_pack_f32(const float *w, int64_t w_stride, int64_t N, int64_t K, float *out) {
    struct pack_job j = {w, w_stride, N, K, out};
    lbd_parallel_for(pack_f32_panel, &j, (N + NR - 1) / NR);
}

void lbd_pack_bf16(const uint16_t *w, int64_t w_stride, int64_t N, int64_t K, uint16_t *out) {
    struct pack_job j = {w, w_stride, N, K, out};
    lbd_parallel_for(pack_bf16_panel, &j, (N + NR - 1) / NR);
}

/* A panel against rows of x (fp32 or bf16; pointers to the first row, panel and column). */
typedef void (*panel_fn)(const void *x, int64_t xs, const void *P, int64_t K, void *y, int64_t ys,
                         const void *bias, int64_t cols, int64_t M, int64_t next_bytes);

/* One call's work split into chunks: row blocks (x that stays in L2) times groups of panels. */
struct gemm_job {
    const void *x, *P, *bias;
    void *y;
    int64_t x_stride, y_stride, N, K, M, block, panels, per_chunk, chunks_per_block, panel_elems, elem;
    panel_fn panel;
};

static int64_t rows_per_pass(int64_t K, int64_t elem) {
    int64_t r = X_BLOCK_BYTES / (K * elem) / MR * MR;
    return r < MR ? MR : r;
}

/* Panels per chunk: enough work (~40 us of FMAs or ~128 KB of weights) to pay for claiming it and to let the
 * next panel stream in behind the current one, yet at least 4 chunks per thread where the matrix allows, so
 * a late or slow thread leaves little behind. */
static void plan(struct gemm_job *j, int64_t elem) {
    j->block = rows_per_pass(j->K, elem);
    j->panels = (j->N + NR - 1) / NR;
    const int64_t rows = j->M < j->block ? j->M : j->block;
    const int64_t fma = rows * j->K * NR, bytes = j->K * NR * elem;
    int64_t per = 1;
    while (per * fma < (4 << 20) && per * bytes < (128 << 10)) per *= 2;
    const int64_t blocks = (j->M + j->block - 1) / j->block;
    const int64_t min_chunks = 4 * lbd_parallel_threads();
    while (per > 1 && blocks * ((j->panels + per - 1) / per) < min_chunks) per /= 2;
    j->per_chunk = per;
    j->chunks_per_block = (j->panels + per - 1) / per;
}

#define TILE_CASES(FN, ...)                  \
    switch (rows) {                          \
        case 1: FN(__VA_ARGS__, 1); break;   \
        case 2: FN(__VA_ARGS__, 2); break;   \
        case 3: FN(__VA_ARGS__, 3); break;   \
        case 4: FN(__VA_ARGS__, 4); break;   \
        case 5: FN(__VA_ARGS__, 5); break;   \
        case 6: FN(__VA_ARGS__, 6); break;   \
        case 7: FN(__VA_ARGS__, 7); break;   \
        case 8: FN(__VA_ARGS__, 8); break;   \
        case 9: FN(__VA_ARGS__, 9); break;   \
        case 10: FN(__VA_ARGS__, 10); break; \
        case 11: FN(__VA_ARGS__, 11); break; \
        default: FN(__VA_ARGS__, 12); break; \
    }

#define TILE_CASES_AVX2(FN, ...)            \
    switch (rows) {                         \
        case 1: FN(__VA_ARGS__, 1); break;  \
        case 2: FN(__VA_ARGS__, 2); break;  \
        case 3: FN(__VA_ARGS__, 3); break;  \
        case 4: FN(__VA_ARGS__, 4); break;  \
        case 5: FN(__VA_ARGS__, 5); break;  \
        default: FN(__VA_ARGS__, 6); break; \
    }

/* The first row tile of a panel reads it from memory, the others from L2: while they run, the next panel
 * (``next_bytes`` bytes right after this one, 0 at a chunk's end) is requested into L2 a slice per tile, so
 * the memory reads are spread over the whole panel instead of bunched at its first tile. */
static inline void prefetch_slice(const char *next, int64_t next_bytes, int64_t tile, int64_t tiles) {
    if (next_bytes == 0 || tiles < 2) return;
    const int64_t from = next_bytes * tile / tiles, to = next_bytes * (tile + 1) / tiles;
    for (int64_t b = from; b < to; b += 64) __builtin_prefetch(next + b, 0, 2); /* to L2 */
}

#if defined(__AVX512F__)
static inline __mmask16 tail_mask(int64_t cols) { return cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1); }

/* Store one tile row: ``cols`` (1..32) valid columns of (c0 | c1) + bias. */
static inline void store_f32(float *y, __m512 c0, __m512 c1, const float *bias, int64_t cols) {
    const __mmask16 m0 = tail_mask(cols), m1 = tail_mask(cols - 16);
    if (bias != NULL) {
        c0 = _mm512_add_ps(c0, _mm512_maskz_loadu_ps(m0, bias));
        if (cols > 16) c1 = _mm512_add_ps(c1, _mm512_maskz_loadu_ps(m1, bias + 16));
    }
    _mm512_mask_storeu_ps(y, m0, c0);
    if (cols > 16) _mm512_mask_storeu_ps(y + 16, m1, c1);
}

static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t xs, const float *P, int64_t K,
                                                           float *y, int64_t ys, const float *bias, int64_t cols,
                                                           const int M) {
    __m512 c0[MR], c1[MR];
    for (int m = 0; m < M; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const __m512 b0 = _mm512_loadu_ps(P + k * NR), b1 = _mm512_loadu_ps(P + k * NR + 16);
        for (int m = 0; m < M; ++m) {
            const __m512 a = _mm512_set1_ps(x[m * xs + k]);
            c0[m] = _mm512_fmadd_ps(a, b0, c0[m]);
            c1[m] = _mm512_fmadd_ps(a, b1, c1[m]);
        }
    }
    for (int m = 0; m < M; ++m) store_f32(y + m * ys, c0[m], c1[m], bias, cols);
}

static void panel_f32(const void *xv, int64_t xs, const void *Pv, int64_t K, void *yv, int64_t ys,
                      const void *bias, int64_t cols, int64_t M, int64_t next_bytes) {
    const float *x = xv, *P = Pv;
    float *y = yv;
    const int64_t tiles = (M + MR - 1) / MR;
    for (int64_t m0 = 0, t = 0; m0 < M; m0 += MR, ++t) {
        const int64_t rows = M - m0 < MR ? M - m0 : MR;
        prefetch_slice((const char *)(P + K * NR), next_bytes, t, tiles);
        TILE_CASES(tile_f32, x + m0 * xs, xs, P, K, y + m0 * ys, ys, bias, cols)
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* A 6 x 16 tile: ``cols`` (1..16) valid columns of a panel's half; P points at the half's first column. */
static inline __attribute__((always_inline)) void tile_f32_avx2(const float *x, int64_t xs, const float *P,
                                                                int64_t K, float *y, int64_t ys, const float *bias,
                                                                int64_t cols, const int M) {
    __m256 c0[MR_AVX2], c1[MR_AVX2];
    for (int m = 0; m < M; ++m) c0[m] = c1[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const __m256 b0 = _mm256_loadu_ps(P + k * NR), b1 = _mm256_loadu_ps(P + k * NR + 8);
        for (int m = 0; m < M; ++m) {
            const __m256 a = _mm256_broadcast_ss(x + m * xs + k);
            c0[m] = _mm256_fmadd_ps(a, b0, c0[m]);
            c1[m] = _mm256_fmadd_ps(a, b1, c1[m]);
        }
    }
    /* through a buffer: indexing the accumulators in a store loop with branches (cols, bias) made gcc keep
     * them on the stack, storing all 12 at every step of k (half the FMA rate) */
    float out[MR_AVX2][16];
    for (int m = 0; m < M; ++m) {
        _mm256_storeu_ps(out[m], c0[m]);
        _mm256_storeu_ps(out[m] + 8, c1[m]);
    }
    for (int m = 0; m < M; ++m)
        for (int64_t c = 0; c < cols; ++c) y[m * ys + c] = bias != NULL ? out[m][c] + bias[c] : out[m][c];
}

static void panel_f32(const void *xv, int64_t xs, const void *Pv, int64_t K, void *yv, int64_t ys,
                      const void *biasv, int64_t cols, int64_t M, int64_t next_bytes) {
    const float *x = xv, *P = Pv, *bias = biasv;
    float *y = yv;
    const int64_t tiles = (M + MR_AVX2 - 1) / MR_AVX2;
    for (int64_t half = 0; half < 2 && 16 * half < cols; ++half) {
        const int64_t hc = cols - 16 * half < 16 ? cols - 16 * half : 16;
        const float *hb = bias == NULL ? NULL : bias + 16 * half;
        for (int64_t m0 = 0, t = 0; m0 < M; m0 += MR_AVX2, ++t) {
            const int64_t rows = M - m0 < MR_AVX2 ? M - m0 : MR_AVX2;
            if (half == 1) prefetch_slice((const char *)(P + K * NR), next_bytes, t, tiles);
            TILE_CASES_AVX2(tile_f32_avx2, x + m0 * xs, xs, P + 16 * half, K, y + m0 * ys + 16 * half, ys, hb, hc)
        }
    }
}
#endif

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
/* The portable fp32 panel: one row of y at a time, its NR sums in an array (vectorised where the level can). */
static void panel_f32(const void *xv, int64_t xs, const void *Pv, int64_t K, void *yv, int64_t ys,
                      const void *biasv, int64_t cols, int64_t M, int64_t next_bytes) {
    const float *x = xv, *P = Pv, *bias = biasv;
    float *y = yv;
    (void)next_bytes;
    for (int64_t m = 0; m < M; ++m) {
        float acc[NR] = {0};
        const float *xm = x + m * xs;
        for (int64_t k = 0; k < K; ++k) {
            const float a = xm[k], *p = P + k * NR;
#pragma omp simd
            for (int c = 0; c < NR; ++c) acc[c] += a * p[c];
        }
        for (int64_t c = 0; c < cols; ++c) y[m * ys + c] = bias != NULL ? acc[c] + bias[c] : acc[c];
    }
}
#endif

static void gemm_chunk(void *arg, int64_t c) {
    const struct gemm_job *j = arg;
    const int64_t r0 = c / j->chunks_per_block * j->block, p0 = c % j->chunks_per_block * j->per_chunk;
    const int64_t rows = j->M - r0 < j->block ? j->M - r0 : j->block;
    const int64_t p1 = p0 + j->per_chunk < j->panels ? p0 + j->per_chunk : j->panels, e = j->elem;
    const char *x = (const char *)j->x + r0 * j->x_stride * e, *bias = j->bias;
    char *y = (char *)j->y + r0 * j->y_stride * e;
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = j->N - p * NR < NR ? j->N - p * NR : NR;
        const int64_t next_bytes = p + 1 < p1 ? j->panel_elems * e : 0;
        j->panel(x, j->x_stride, (const char *)j->P + p * j->panel_elems * e, j->K, y + p * NR * e, j->y_stride,
                 bias == NULL ? NULL : bias + p * NR * e, cols, rows, next_bytes);
    }
}

int lbd_packed_gemm_f32(const float *x, int64_t x_stride, const float *P, int64_t N, int64_t K, const float *bias,
                        float *y, int64_t y_stride, int64_t M) {
    struct gemm_job j = {.x = x, .P = P, .bias = bias, .y = y, .x_stride = x_stride, .y_stride = y_stride,
                         .N = N, .K = K, .M = M, .panel_elems = K * NR, .elem = 4, .panel = panel_f32};
    plan(&j, 4);
    lbd_parallel_for(gemm_chunk, &j, (M + j.block - 1) / j.block * j.chunks_per_block);
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

static inline void store_bf16(uint16_t *y, __m512 c0, __m512 c1, const uint16_t *bias, int64_t cols) {
    const __mmask16 m0 = tail_mask(cols), m1 = tail_mask(cols - 16);
    if (bias != NULL) {
        c0 = _mm512_add_ps(c0, bf16_to_f32(_mm256_maskz_loadu_epi16(m0, bias)));
        if (cols > 16) c1 = _mm512_add_ps(c1, bf16_to_f32(_mm256_maskz_loadu_epi16(m1, bias + 16)));
    }
    _mm256_mask_storeu_epi16(y, m0, (__m256i)_mm512_cvtneps_pbh(c0));
    if (cols > 16) _mm256_mask_storeu_epi16(y + 16, m1, (__m256i)_mm512_cvtneps_pbh(c1));
}

static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t xs, const uint16_t *P,
                                                            int64_t K, uint16_t *y, int64_t ys,
                                                            const uint16_t *bias, int64_t cols, const int M) {
    __m512 c0[MR], c1[MR];
    for (int m = 0; m < M; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(P + k2 * 2 * NR);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(P + k2 * 2 * NR + NR);
        for (int m = 0; m < M; ++m) {
            int32_t pair;
            memcpy(&pair, x + m * xs + 2 * k2, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            c0[m] = _mm512_dpbf16_ps(c0[m], a, b0);
            c1[m] = _mm512_dpbf16_ps(c1[m], a, b1);
        }
    }
    if (K % 2) { /* the last k alone: its partner in the packed pair is zero, so pair it with a zero x */
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(P + pairs * 2 * NR);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(P + pairs * 2 * NR + NR);
        for (int m = 0; m < M; ++m) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int32_t)x[m * xs + K - 1]);
            c0[m] = _mm512_dpbf16_ps(c0[m], a, b0);
            c1[m] = _mm512_dpbf16_ps(c1[m], a, b1);
        }
    }
    for (int m = 0; m < M; ++m) store_bf16(y + m * ys, c0[m], c1[m], bias, cols);
}

static void panel_bf16(const void *xv, int64_t xs, const void *Pv, int64_t K, void *yv, int64_t ys,
                       const void *bias, int64_t cols, int64_t M, int64_t next_bytes) {
    const uint16_t *x = xv, *P = Pv;
    uint16_t *y = yv;
    const int64_t tiles = (M + MR - 1) / MR;
    for (int64_t m0 = 0, t = 0; m0 < M; m0 += MR, ++t) {
        const int64_t rows = M - m0 < MR ? M - m0 : MR;
        prefetch_slice((const char *)(P + (K + 1) / 2 * 2 * NR), next_bytes, t, tiles);
        TILE_CASES(tile_bf16, x + m0 * xs, xs, P, K, y + m0 * ys, ys, bias, cols)
    }
}
#else
static inline float bf16_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* round to nearest even, like torch; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* The portable bf16 panel: fp32 sums of the widened pairs, one rounding to bf16 per output, as VDPBF16PS. */
static void panel_bf16(const void *xv, int64_t xs, const void *Pv, int64_t K, void *yv, int64_t ys,
                       const void *biasv, int64_t cols, int64_t M, int64_t next_bytes) {
    const uint16_t *x = xv, *P = Pv, *bias = biasv;
    uint16_t *y = yv;
    (void)next_bytes;
    for (int64_t m = 0; m < M; ++m) {
        float acc[NR] = {0}, w[2 * NR];
        const uint16_t *xm = x + m * xs;
        for (int64_t k2 = 0; k2 < (K + 1) / 2; ++k2) {
            const float a0 = bf16_f32(xm[2 * k2]), a1 = 2 * k2 + 1 < K ? bf16_f32(xm[2 * k2 + 1]) : 0.0f;
            const uint16_t *p = P + k2 * 2 * NR;
            for (int c = 0; c < 2 * NR; ++c) w[c] = bf16_f32(p[c]);
#pragma omp simd
            for (int c = 0; c < NR; ++c) acc[c] += a0 * w[2 * c] + a1 * w[2 * c + 1];
        }
        for (int64_t c = 0; c < cols; ++c)
            y[m * ys + c] = f32_bf16(bias != NULL ? acc[c] + bf16_f32(bias[c]) : acc[c]);
    }
}
#endif


int lbd_packed_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *P, int64_t N, int64_t K,
                         const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t M) {
    struct gemm_job j = {.x = x, .P = P, .bias = bias, .y = y, .x_stride = x_stride, .y_stride = y_stride,
                         .N = N, .K = K, .M = M, .panel_elems = (K + 1) / 2 * 2 * NR, .elem = 2,
                         .panel = panel_bf16};
    plan(&j, 2);
    lbd_parallel_for(gemm_chunk, &j, (M + j.block - 1) / j.block * j.chunks_per_block);
    return 0;
}
