/* A Llama-family decoder stack in one call (fp32): every layer's kernels chained in C, with no Python between
 * them.
 *
 * Why: the same kernels called one by one from Python cost ~14 ms of a 127 ms decode step of 59 sequences
 * beyond their own time (measured: the C calls summed to 112 ms of the forward). Each layer is ten torch/ctypes
 * calls, and after the matmuls and attention have streamed hundreds of MB through the caches the interpreter's
 * own objects come back from memory every time. Here the only per-layer work besides the kernels is pointer
 * arithmetic. The kernels and their argument values are exactly those of the Python path (engine/models/
 * llama.py), so the outputs are bit-identical to it.
 *
 * Per layer, with h the previous layer's output and res the residual stream (layer 0: res = the embeddings):
 *   xn, res = rms_norm(h + res)          (layer 0: xn = rms_norm(res))
 *   qkv = xn Wqkv^T; rotary(q, k); write k, v to the caches at slots; attn = paged attention of q
 *   h = attn Wo^T; xn, res = rms_norm(h + res); h = silu_and_mul(xn Wgu^T) Wdown^T
 * and after the last: out = final_norm(h + res). Attention rows are the step's tokens: a decode, or a token of
 * a short prefill, reads the first lens[t] tokens of its sequence (tables row t = its block table).
 */
#include <stdint.h>
#include <time.h>

int lbd_packed_gemm_f32(const float *x, int64_t x_stride, const float *P, int64_t N, int64_t K, const float *bias,
                        float *y, int64_t y_stride, int64_t M);
void lbd_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *new_residual,
                      const float *weight, float *out, int64_t T, int64_t D, float eps);
void lbd_rotary_neox_f32(const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
                         const float *cos_sin, int64_t T, int64_t Hq, int64_t Hk, int64_t head_dim, int64_t rot_dim);
void lbd_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *kc, void *vc,
                  const int64_t *slots, int64_t T, int64_t row_bytes);
int lbd_paged_decode_f32(const float *q, int64_t q_row_stride, const float *kc, const float *vc,
                         const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, float *out,
                         int64_t out_row_stride, int64_t H, int64_t Hkv, int64_t D, int64_t BS, float scale,
                         int64_t B, int64_t max_len);
void lbd_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t I);

/* layers[l * LAYER_PTRS + i]: layer l's pointers, in this order (packed weights as packed_gemm.c lays them) */
enum { IN_NORM, QKV, O_PROJ, POST_NORM, GATE_UP, DOWN, KEY_CACHE, VALUE_CACHE, LAYER_PTRS };
/* dims[i] */
enum { HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK_SIZE, ROT_DIM, DIMS };
/* times[i], seconds added when times != NULL (the step profiler's groups) */
enum { T_ATTENTION, T_LINEAR };

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

struct clock {
    double *times, t0;
};

static void tick(struct clock *c) {
    if (c->times != NULL) c->t0 = seconds();
}

static void tock(struct clock *c, int group) {
    if (c->times != NULL) c->times[group] += seconds() - c->t0;
}

static void gemm(struct clock *c, const float *x, int64_t K, int64_t w, int64_t N, float *y, int64_t T) {
    tick(c);
    lbd_packed_gemm_f32(x, K, (const float *)(intptr_t)w, N, K, NULL, y, N, T); /* takes every shape */
    tock(c, T_LINEAR);
}

/* Buffers (fp32, rows dense): embed [T, HIDDEN] holds the embeddings and then the residual stream; h, out
 * [T, HIDDEN]; qkv [T, (HEADS + 2 KV_HEADS) HEAD_DIM]; attn [T, HEADS HEAD_DIM]; gate_up [T, 2 INTERMEDIATE];
 * act [T, INTERMEDIATE]. out = the final norm of the last layer's output. Returns 0, or -1 when attention could
 * not allocate its score buffer (as lbd_paged_decode_f32). */
int lbd_decoder_f32(const int64_t *layers, int64_t L, const int64_t *dims, float eps, float scale,
                    const float *cos_sin, const float *final_norm, int64_t T, const int64_t *positions,
                    const int64_t *slots, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                    int64_t max_len, float *embed, float *h, float *out, float *qkv, float *attn, float *gate_up,
                    float *act, double *times) {
    const int64_t D = dims[HIDDEN], H = dims[HEADS], Hkv = dims[KV_HEADS], d = dims[HEAD_DIM];
    const int64_t I = dims[INTERMEDIATE], q_size = H * d, kv_size = Hkv * d, n_qkv = q_size + 2 * kv_size;
    float *const res = embed, *const xn = out;
    struct clock c = {times, 0.0};
    for (int64_t l = 0; l < L; ++l) {
        const int64_t *w = layers + l * LAYER_PTRS;
        if (l == 0)
            lbd_rms_norm_f32(res, D, NULL, NULL, (const float *)(intptr_t)w[IN_NORM], xn, T, D, eps);
        else
            lbd_rms_norm_f32(h, D, res, res, (const float *)(intptr_t)w[IN_NORM], xn, T, D, eps);
        gemm(&c, xn, D, w[QKV], n_qkv, qkv, T);
        float *k = qkv + q_size, *v = k + kv_size;
        lbd_rotary_neox_f32(positions, qkv, n_qkv, k, n_qkv, cos_sin, T, H, Hkv, d, dims[ROT_DIM]);
        tick(&c);
        void *kc = (void *)(intptr_t)w[KEY_CACHE], *vc = (void *)(intptr_t)w[VALUE_CACHE];
        lbd_write_kv(k, n_qkv * 4, v, n_qkv * 4, kc, vc, slots, T, kv_size * 4);
        const int failed = lbd_paged_decode_f32(qkv, n_qkv, kc, vc, tables, table_stride, lens, attn, q_size, H,
                                                Hkv, d, dims[BLOCK_SIZE], scale, T, max_len);
        tock(&c, T_ATTENTION);
        if (failed) return -1;
        gemm(&c, attn, q_size, w[O_PROJ], D, h, T);
        lbd_rms_norm_f32(h, D, res, res, (const float *)(intptr_t)w[POST_NORM], xn, T, D, eps);
        gemm(&c, xn, D, w[GATE_UP], 2 * I, gate_up, T);
        lbd_silu_and_mul_f32(gate_up, 2 * I, act, T, I);
        gemm(&c, act, I, w[DOWN], D, h, T);
    }
    lbd_rms_norm_f32(h, D, res, res, final_norm, out, T, D, eps);
    return 0;
}
