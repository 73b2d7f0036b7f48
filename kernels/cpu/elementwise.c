/* The small per-token ops of a decoder layer for the CPU, fp32: RMSNorm (with the residual add fused) and
 * neox rotary embedding. (SiLU-and-mul stays in torch: its vectorised exp beat a C loop over libm's expf.)
 *
 * Each is a handful of torch ops in the reference, and at decode batch sizes a torch op costs more in
 * dispatch and thread wake-ups than in arithmetic (measured: ~40 ms of a 280 ms decode step of 64
 * sequences). Here each is one pass over its rows; rows are split over torch's OpenMP threads only when
 * there are enough of them to pay for the wake-up.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMENTS 65536

/* out = x_sum * weight / rms(x_sum), x_sum = x + residual (stored to new_residual) when residual != NULL.
 * Sums in fp32 like transformers' LlamaRMSNorm. Rows are ``stride`` floats apart in x (the others are dense). */
void lbd_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *new_residual,
                      const float *weight, float *out, int64_t T, int64_t D, float eps) {
#pragma omp parallel for if (T * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; ++t) {
        const float *xr = x + t * x_stride;
        float *o = out + t * D;
        const float *src = xr;
        if (residual != NULL) {
            float *nr = new_residual + t * D;
            const float *rr = residual + t * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) nr[i] = xr[i] + rr[i];
            src = nr;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < D; ++i) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) o[i] = weight[i] * (src[i] * inv);
    }
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

/* Neox rotary in place on q [T, Hq*d] and k [T, Hk*d] (rows q_stride / k_stride floats apart): the first
 * rot_dim dims of each head turn by cos_sin[positions[t]] = [cos(rot_dim/2) | sin(rot_dim/2)]. */
void lbd_rotary_neox_f32(const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
                         const float *cos_sin, int64_t T, int64_t Hq, int64_t Hk, int64_t head_dim,
                         int64_t rot_dim) {
    const int64_t half = rot_dim / 2;
#pragma omp parallel for if (T * (Hq + Hk) * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; ++t) {
        const float *cos = cos_sin + positions[t] * rot_dim, *sin = cos + half;
        rotate_heads(q + t * q_stride, Hq, head_dim, half, cos, sin);
        rotate_heads(k + t * k_stride, Hk, head_dim, half, cos, sin);
    }
}
