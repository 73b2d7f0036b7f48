/* Decode attention over a paged KV cache for the CPU, reading K/V in place.
 *
 * The torch reference gathers each sequence's blocks into a dense copy before SDPA: for 64 decodes of
 * ~500 tokens that is ~1.5 GB written and read again per step, more time than the model's matmuls. Here
 * each sequence walks its block table and reads every K and V row once, in two passes: the scores of all
 * query heads (a head reads its kv head's part of the row: GQA without copies), a softmax per head
 * (max-subtracted, the same math as SDPA), then the probability-weighted sum of V rows.
 * Layouts: q/out [B, H, D] with row strides in elements, caches [num_blocks, BS, Hkv, D] contiguous,
 * block_tables [B, bt_stride] int32, seq_lens [B] int32 (0 = padding: the output rows are zero).
 * bf16 (lbd_paged_decode_bf16): a sequence's K and V rows are widened to fp32 in the thread's L2 buffer, once
 * each, and the fp32 passes run on them: the memory reads halve, the math stays fp32 like SDPA's.
 */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

/* One 64-byte vector per step and a single horizontal sum per dot: left to itself, gcc reduces the
 * vectorised dot through 16 dependent scalar adds, which made this pass 5x slower than its memory reads. */
static inline float dot(const float *a, const float *b, int64_t D) {
    int64_t i = 0;
    float acc = 0.0f;
#if defined(__AVX512F__)
    __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
    for (; i + 32 <= D; i += 32) {
        v0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v0);
        v1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), v1);
    }
    for (; i + 16 <= D; i += 16) v0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v0);
    acc = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
    for (; i + 16 <= D; i += 16) {
        v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v0);
        v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), v1);
    }
    for (; i + 8 <= D; i += 8) v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v0);
    v0 = _mm256_add_ps(v0, v1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v0), _mm256_extractf128_ps(v0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    acc = _mm_cvtss_f32(h);
#endif
    for (; i < D; ++i) acc += a[i] * b[i];
    return acc;
}

/* Blocks sit anywhere in the cache, so the hardware prefetcher loses the stream at each block boundary. The
 * scores pass therefore requests, PREFETCH_ROWS tokens ahead through the block table, that token's K row into
 * L1 and its V row into L2: the V pass then reads from L2, and the two streams keep more loads in flight than
 * one. `benchmarks/cpu_decode_attention.py` (64 sequences of ~190 tokens, 30 layers, blocks shuffled, cold
 * caches), against asking only for K's same row of the next block: 42.1 -> 34.2 ms per step with 16-token
 * blocks, 39.9 -> 31.2 ms with 64-token blocks; with hot caches (--hot) the extra prefetches cost 5%, but a
 * decode step reads every layer's K/V from memory. */
#define PREFETCH_ROWS 8

/* always_inline: gcc 12 takes a helper made only of prefetches for a function without side effects and drops
 * its calls (the prefetches vanished from the binary); inlined, they stay. */
static inline __attribute__((always_inline)) void prefetch_row(const float *r, int64_t n, int to_l2) {
    for (int64_t i = 0; i < n; i += 16) {
        if (to_l2)
            __builtin_prefetch(r + i, 0, 2);
        else
            __builtin_prefetch(r + i, 0, 3);
    }
}

/* The next token to prefetch, walked along one sequence's block table (no division per token). */
struct prefetch_cursor {
    int64_t t, blk, off;
};

/* Token ``c->t``'s K row to L1 and V row to L2, then step to the next token (none past L). */
static inline __attribute__((always_inline)) void prefetch_next(struct prefetch_cursor *c, const float *kc,
                                                                 const float *vc, const int32_t *bt, int64_t L,
                                                                 int64_t BS, int64_t row) {
    if (c->t >= L) return;
    const int64_t at = ((int64_t)bt[c->blk] * BS + c->off) * row;
    prefetch_row(kc + at, row, 0);
    prefetch_row(vc + at, row, 1);
    ++c->t;
    if (++c->off == BS) c->off = 0, ++c->blk;
}

/* scores s[h * L + t] of every query head against every key of one sequence, block by block: a block's
 * rows are contiguous (all kv heads of a token side by side), so the reads stream within a block. */
static void scores(const float *qb, const float *kc, const float *vc, const int32_t *bt, int64_t L, int64_t H,
                   int64_t G, int64_t D, int64_t BS, int64_t row, float scale, float *s) {
    struct prefetch_cursor ahead = {0, 0, 0};
    for (int i = 0; i < PREFETCH_ROWS; ++i) prefetch_next(&ahead, kc, vc, bt, L, BS, row);
    for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
        const float *k = kc + (int64_t)bt[blk] * BS * row;
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        for (int64_t j = 0; j < n; ++j, k += row) {
            prefetch_next(&ahead, kc, vc, bt, L, BS, row);
            for (int64_t h = 0; h < H; ++h) s[h * L + t0 + j] = dot(qb + h * D, k + (h / G) * D, D) * scale;
        }
    }
}

#include "vexp.h"

static void softmax_rows(float *s, int64_t H, int64_t L) {
    for (int64_t h = 0; h < H; ++h) {
        float *r = s + h * L;
#if defined(__AVX512F__)
        if (L >= 16) {
            __m512 mv = _mm512_loadu_ps(r);
            int64_t t = 16;
            for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(r + t));
            float m = _mm512_reduce_max_ps(mv);
            for (; t < L; ++t) m = r[t] > m ? r[t] : m;
            const __m512 mb = _mm512_set1_ps(m);
            __m512 sv = _mm512_setzero_ps();
            for (t = 0; t + 16 <= L; t += 16) {
                const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(r + t), mb));
                _mm512_storeu_ps(r + t, e);
                sv = _mm512_add_ps(sv, e);
            }
            if (t < L) {
                const __mmask16 k = (__mmask16)((1u << (L - t)) - 1);
                const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, r + t), mb));
                _mm512_mask_storeu_ps(r + t, k, e);
                sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
            }
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sv));
            for (t = 0; t + 16 <= L; t += 16) _mm512_storeu_ps(r + t, _mm512_mul_ps(_mm512_loadu_ps(r + t), inv));
            for (; t < L; ++t) r[t] *= _mm512_cvtss_f32(inv);
            continue;
        }
#endif
        float m = r[0];
        for (int64_t t = 1; t < L; ++t) m = r[t] > m ? r[t] : m;
        float sum = 0.0f;
        for (int64_t t = 0; t < L; ++t) {
            r[t] = expf(r[t] - m);
            sum += r[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < L; ++t) r[t] *= inv;
    }
}

#if defined(__AVX512F__)
/* One head's output (n 16-float chunks, unrolled for the common head sizes) held in registers across the
 * whole context; the V rows come from L2 (the scores pass asked for them) for every head of a kv head. */
static inline __attribute__((always_inline)) void head_values_avx512(const float *p, const float *vc,
                                                                      const int32_t *bt, int64_t L, int64_t BS,
                                                                      int64_t row, int64_t head_off, float *o,
                                                                      const int n) {
    __m512 acc[8];
    for (int c = 0; c < n; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
        const float *v = vc + (int64_t)bt[blk] * BS * row + head_off;
        const int64_t m = L - t0 < BS ? L - t0 : BS;
        for (int64_t j = 0; j < m; ++j, v += row) {
            const __m512 w = _mm512_set1_ps(p[t0 + j]);
            for (int c = 0; c < n; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), acc[c]);
        }
    }
    for (int c = 0; c < n; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
}
#endif

/* o[h] = sum_t p[h, t] * v_t. The portable loop is token-outer so each V row is read once for all heads;
 * their accumulations into the (L1-resident) output rows are independent of each other. */
static void weighted_values(const float *p, const float *vc, const int32_t *bt, int64_t L, int64_t H,
                            int64_t G, int64_t D, int64_t BS, int64_t row, float *o) {
#if defined(__AVX512F__)
    if (D == 64 || D == 128) {
        for (int64_t h = 0; h < H; ++h) {
            if (D == 64)
                head_values_avx512(p + h * L, vc, bt, L, BS, row, (h / G) * D, o + h * D, 4);
            else
                head_values_avx512(p + h * L, vc, bt, L, BS, row, (h / G) * D, o + h * D, 8);
        }
        return;
    }
#endif
    memset(o, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
        const float *v = vc + (int64_t)bt[blk] * BS * row;
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        for (int64_t j = 0; j < n; ++j, v += row)
            for (int64_t h = 0; h < H; ++h) {
                const float w = p[h * L + t0 + j];
                const float *vh = v + (h / G) * D;
                float *oh = o + h * D;
#pragma omp simd
                for (int64_t i = 0; i < D; ++i) oh[i] += w * vh[i];
            }
    }
}

struct decode_job {
    const void *q, *kc, *vc;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int64_t q_row_stride, bt_stride, out_row_stride, H, Hkv, D, BS, max_len;
    float scale;
    _Atomic int failed;
};

/* The score buffer of the thread running a sequence: grown as needed, kept for the thread's life. */
static float *scratch(int64_t floats) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    if (floats > cap) {
        float *grown = realloc(buf, (size_t)floats * sizeof(float));
        if (grown == NULL) return NULL;
        buf = grown;
        cap = floats;
    }
    return buf;
}

static void decode_one(void *arg, int64_t b) {
    struct decode_job *j = arg;
    const int64_t L = j->seq_lens[b], G = j->H / j->Hkv, row = j->Hkv * j->D;
    float *o = (float *)j->out + b * j->out_row_stride;
    float *s = L > 0 ? scratch(j->H * L) : NULL;
    if (L <= 0 || s == NULL) {
        if (L > 0) atomic_store(&j->failed, 1);
        memset(o, 0, (size_t)(j->H * j->D) * sizeof(float));
        return;
    }
    const int32_t *bt = j->block_tables + b * j->bt_stride;
    scores((const float *)j->q + b * j->q_row_stride, j->kc, j->vc, bt, L, j->H, G, j->D, j->BS, row, j->scale,
           s);
    softmax_rows(s, j->H, L);
    weighted_values(s, j->vc, bt, L, j->H, G, j->D, j->BS, row, o);
}

static void widen(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16)));
#endif
    for (; i < n; ++i) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

static void narrow(const float *src, uint16_t *dst, int64_t n) { /* round to nearest even, like torch */
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        dst[i] = (src[i] != src[i]) ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
}

/* A whole sequence's blocks of one cache, widened into dense fp32 rows [L, row]. */
static void widen_blocks(const uint16_t *cache, const int32_t *bt, int64_t L, int64_t BS, int64_t row,
                         float *dst) {
    for (int64_t t0 = 0, blk = 0; t0 < L; t0 += BS, ++blk) {
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        widen(cache + (int64_t)bt[blk] * BS * row, dst + t0 * row, n * row);
    }
}

static void decode_one_bf16(void *arg, int64_t b) {
    struct decode_job *j = arg;
    const int64_t L = j->seq_lens[b], H = j->H, D = j->D, G = H / j->Hkv, row = j->Hkv * D;
    uint16_t *o = (uint16_t *)j->out + b * j->out_row_stride;
    float *s = L > 0 ? scratch(H * L + 2 * L * row + 2 * H * D) : NULL;
    if (L <= 0 || s == NULL) {
        if (L > 0) atomic_store(&j->failed, 1);
        memset(o, 0, (size_t)(H * D) * sizeof(uint16_t));
        return;
    }
    float *k = s + H * L, *v = k + L * row, *q = v + L * row, *out = q + H * D;
    const int32_t *bt = j->block_tables + b * j->bt_stride;
    const int32_t dense = 0; /* the widened rows are one block of L tokens */
    widen((const uint16_t *)j->q + b * j->q_row_stride, q, H * D);
    widen_blocks(j->kc, bt, L, j->BS, row, k);
    widen_blocks(j->vc, bt, L, j->BS, row, v); /* before the scores pass, which prefetches V's rows */
    scores(q, k, v, &dense, L, H, G, D, L, row, j->scale, s);
    softmax_rows(s, H, L);
    weighted_values(s, v, &dense, L, H, G, D, L, row, out);
    narrow(out, o, H * D);
}

static int run_decode(lbd_task_fn fn, const void *q, int64_t q_row_stride, const void *kc, const void *vc,
                      const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, void *out,
                      int64_t out_row_stride, int64_t H, int64_t Hkv, int64_t D, int64_t BS, float scale,
                      int64_t B, int64_t max_len) {
    struct decode_job j = {q, kc, vc, block_tables, seq_lens, out, q_row_stride, bt_stride, out_row_stride,
                           H, Hkv, D, BS, max_len, scale, 0};
    lbd_parallel_for(fn, &j, B);
    return atomic_load(&j.failed) ? -1 : 0;
}

/* All B sequences, one chunk each (their lengths differ, so they are claimed one at a time) over the
 * kernels' threads (pool.h). Returns -1 when a score buffer could not be allocated (those rows are zero). */
int lbd_paged_decode_f32(const float *q, int64_t q_row_stride, const float *kc, const float *vc,
                         const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, float *out,
                         int64_t out_row_stride, int64_t H, int64_t Hkv, int64_t D, int64_t BS, float scale,
                         int64_t B, int64_t max_len) {
    return run_decode(decode_one, q, q_row_stride, kc, vc, block_tables, bt_stride, seq_lens, out, out_row_stride,
                      H, Hkv, D, BS, scale, B, max_len);
}

int lbd_paged_decode_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kc, const uint16_t *vc,
                          const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, uint16_t *out,
                          int64_t out_row_stride, int64_t H, int64_t Hkv, int64_t D, int64_t BS, float scale,
                          int64_t B, int64_t max_len) {
    return run_decode(decode_one_bf16, q, q_row_stride, kc, vc, block_tables, bt_stride, seq_lens, out,
                      out_row_stride, H, Hkv, D, BS, scale, B, max_len);
}

struct write_job {
    const char *key, *value;
    char *kc, *vc;
    const int64_t *slots;
    int64_t key_stride, value_stride, row_bytes, T;
};

#define WRITE_ROWS 64 /* tokens per chunk of the pool */

static void write_rows(void *arg, int64_t chunk) {
    const struct write_job *j = arg;
    const int64_t t1 = (chunk + 1) * WRITE_ROWS < j->T ? (chunk + 1) * WRITE_ROWS : j->T;
    for (int64_t t = chunk * WRITE_ROWS; t < t1; ++t) {
        const int64_t s = j->slots[t];
        if (s < 0) continue; /* padding */
        memcpy(j->kc + s * j->row_bytes, j->key + t * j->key_stride, (size_t)j->row_bytes);
        memcpy(j->vc + s * j->row_bytes, j->value + t * j->value_stride, (size_t)j->row_bytes);
    }
}

/* Store token t's key and value rows (row_bytes each; rows key_stride / value_stride bytes apart) at slot
 * slots[t] of the caches, viewed as [slots, row_bytes] (slot -1 = skip): the reference's pair of index_copy_
 * in one pass, without the check of the slots' minimum it needs per layer. Any dtype the caches share with
 * the rows. */
void lbd_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride, void *kc,
                  void *vc, const int64_t *slots, int64_t T, int64_t row_bytes) {
    struct write_job j = {key, value, kc, vc, slots, key_stride, value_stride, row_bytes, T};
    lbd_parallel_for(write_rows, &j, (T + WRITE_ROWS - 1) / WRITE_ROWS);
}
