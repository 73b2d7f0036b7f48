/* The small per-token ops of a decoder layer for the CPU, fp32: RMSNorm (with the residual add fused), neox
 * rotary embedding and SiLU-and-mul; and the greedy sampler's argmax over each row of the logits. SiLU needs a vector exp (vexp.h: a loop over libm's scalar expf lost to
 * torch's vectorised one); it is here so a prefill's [T, 2I] activations are split over the kernels' threads
 * like every other op, instead of running on torch's one thread beside the pool.
 *
 * Each is a handful of torch ops in the reference, and at decode batch sizes a torch op costs more in
 * dispatch and thread wake-ups than in arithmetic (measured: ~40 ms of a 280 ms decode step of 64
 * sequences). Here each is one pass over its rows; rows are split over the kernels' threads (pool.h) only
 * when there are enough of them to pay for the wake-up.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "pool.h"
#include "vexp.h"

#define CHUNK_ELEMENTS 32768 /* rows per chunk of the kernels' threads: about this many elements */

/* Rows [0, T) in chunks of about CHUNK_ELEMENTS elements, of equal size: 59 rows of 576 are two chunks of 30
 * and 29 rows, not 56 and 3 (which left the second thread almost idle); one chunk below CHUNK_ELEMENTS. */
static void for_row_chunks(lbd_task_fn fn, void *job, int64_t T, int64_t elements_per_row, int64_t *rows) {
    if (T <= 0) return; /* e.g. a DP rank's dummy pass over no tokens */
    int64_t chunks = (T * (elements_per_row > 0 ? elements_per_row : 1) + CHUNK_ELEMENTS - 1) / CHUNK_ELEMENTS;
    if (chunks > T) chunks = T;
    if (chunks < 1) chunks = 1;
    *rows = (T + chunks - 1) / chunks;
    lbd_parallel_for(fn, job, (T + *rows - 1) / *rows);
}

/* One past the last row of chunk ``chunk`` (chunks of ``rows`` rows over [0, T)). */
static inline int64_t rows_end(int64_t chunk, int64_t rows, int64_t T) {
    return (chunk + 1) * rows < T ? (chunk + 1) * rows : T;
}

struct norm_job {
    const float *x, *residual, *weight;
    float *new_residual, *out;
    int64_t x_stride, T, D, rows;
    float eps;
};

static void norm_rows(void *arg, int64_t chunk) {
    const struct norm_job *j = arg;
    const int64_t D = j->D, t1 = rows_end(chunk, j->rows, j->T);
    for (int64_t t = chunk * j->rows; t < t1; ++t) {
        const float *xr = j->x + t * j->x_stride;
        float *o = j->out + t * D;
        const float *src = xr;
        if (j->residual != NULL) {
            float *nr = j->new_residual + t * D;
            const float *rr = j->residual + t * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) nr[i] = xr[i] + rr[i];
            src = nr;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < D; ++i) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + j->eps);
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) o[i] = j->weight[i] * (src[i] * inv);
    }
}

/* out = x_sum * weight / rms(x_sum), x_sum = x + residual (stored to new_residual) when residual != NULL.
 * Sums in fp32 like transformers' LlamaRMSNorm. Rows are ``stride`` floats apart in x (the others are dense). */
void lbd_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *new_residual,
                      const float *weight, float *out, int64_t T, int64_t D, float eps) {
    struct norm_job j = {x, residual, weight, new_residual, out, x_stride, T, D, 0, eps};
    for_row_chunks(norm_rows, &j, T, D, &j.rows);
}

static void rotate_heads(float *x, int64_t heads, int64_t head_dim, int64_t half, const float *cos,
                         const float *sin) {
    for (int64_t h = 0; h < heads; ++h) {
        float *x1 = x + h * head_dim, *x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

struct rotary_job {
    const int64_t *positions;
    float *q, *k;
    const float *cos_sin;
    int64_t q_stride, k_stride, T, Hq, Hk, head_dim, rot_dim, rows;
};

static void rotary_rows(void *arg, int64_t chunk) {
    const struct rotary_job *j = arg;
    const int64_t half = j->rot_dim / 2, t1 = rows_end(chunk, j->rows, j->T);
    for (int64_t t = chunk * j->rows; t < t1; ++t) {
        const float *cos = j->cos_sin + j->positions[t] * j->rot_dim, *sin = cos + half;
        rotate_heads(j->q + t * j->q_stride, j->Hq, j->head_dim, half, cos, sin);
        rotate_heads(j->k + t * j->k_stride, j->Hk, j->head_dim, half, cos, sin);
    }
}

/* Neox rotary in place on q [T, Hq*d] and k [T, Hk*d] (rows q_stride / k_stride floats apart): the first
 * rot_dim dims of each head turn by cos_sin[positions[t]] = [cos(rot_dim/2) | sin(rot_dim/2)]. */
void lbd_rotary_neox_f32(const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
                         const float *cos_sin, int64_t T, int64_t Hq, int64_t Hk, int64_t head_dim,
                         int64_t rot_dim) {
    struct rotary_job j = {positions, q, k, cos_sin, q_stride, k_stride, T, Hq, Hk, head_dim, rot_dim, 0};
    for_row_chunks(rotary_rows, &j, T, (Hq + Hk) * head_dim, &j.rows);
}

struct silu_job {
    const float *x;
    float *out;
    int64_t x_stride, T, I, rows;
};

static void silu_rows(void *arg, int64_t chunk) {
    const struct silu_job *j = arg;
    const int64_t I = j->I, t1 = rows_end(chunk, j->rows, j->T);
    for (int64_t t = chunk * j->rows; t < t1; ++t) {
        const float *g = j->x + t * j->x_stride, *u = g + I;
        float *o = j->out + t * I;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
        for (; i + 16 <= I; i += 16) {
            /* sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below (no overflow) */
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = exp_nonpositive(_mm512_or_ps(gv, sign));
            const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
            const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sig = _mm512_mask_mul_ps(r, neg, r, e);
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < I; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out [T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I] with rows x_stride floats apart. */
void lbd_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t I) {
    struct silu_job j = {x, out, x_stride, T, I, 0};
    for_row_chunks(silu_rows, &j, T, 2 * I, &j.rows);
}

/* The index of a row's largest value, the first one on ties, as torch.argmax: a NaN counts as the largest. */
static int64_t argmax_scalar(const float *x, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; ++i) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static int64_t argmax_row(const float *x, int64_t V) {
#if defined(__AVX512F__)
    if (V < 32) return argmax_scalar(x, V);
    /* each lane keeps its first maximum (strict >); the lowest index among the lanes holding the overall
     * maximum is then the row's first one */
    __m512 best = _mm512_loadu_ps(x);
    __m512i best_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = best_i;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        idx = _mm512_add_epi32(idx, step);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, v);
        best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    }
    if (nan) return argmax_scalar(x, V);
    float m = _mm512_reduce_max_ps(best);
    const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    int64_t r = _mm512_mask_reduce_min_epi32(at_max, best_i);
    for (; i < V; ++i) { /* the tail: later indices, so only a strictly larger value (or a NaN) wins */
        if (isnan(x[i])) return i;
        if (x[i] > m) m = x[i], r = i;
    }
    return r;
#else
    return argmax_scalar(x, V);
#endif
}

struct argmax_job {
    const float *x;
    int64_t *out;
    int64_t x_stride, T, V, rows;
};

static void argmax_rows(void *arg, int64_t chunk) {
    const struct argmax_job *j = arg;
    const int64_t t1 = rows_end(chunk, j->rows, j->T);
    for (int64_t t = chunk * j->rows; t < t1; ++t) j->out[t] = argmax_row(j->x + t * j->x_stride, j->V);
}

/* out[t] = argmax of row t of x [T, V] (rows x_stride floats apart), for V >= 1. torch's argmax over 64 rows
 * of a 49k vocabulary took 3-5 ms of a decode step on one thread; this reads them on the kernels' threads. */
void lbd_argmax_f32(const float *x, int64_t x_stride, int64_t T, int64_t V, int64_t *out) {
    struct argmax_job j = {x, out, x_stride, T, V, 0};
    for_row_chunks(argmax_rows, &j, T, V, &j.rows);
}
