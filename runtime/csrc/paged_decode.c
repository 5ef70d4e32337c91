/* Paged decode attention for the CPU: one query token per sequence against its paged KV, float32 or
 * bfloat16 (q, caches and out in the same dtype; bf16 rows are widened to float32 a block at a time into a
 * scratch buffer, so the arithmetic is float32 either way and the cache is read once, in place).
 *
 * Layout (all contiguous): q and out [S, H, D]; k_cache and v_cache [num_blocks, block_size, KVH, D];
 * block_tables [S, table_stride] int32; context_lens [S] int32. KV head j serves query heads
 * j*G .. j*G+G-1 (G = H / KVH). Each (sequence, KV head) is one unit of work: it reads its blocks once, in
 * place, with an online softmax, so nothing is gathered or padded to the longest sequence. Units are
 * handed out through an atomic counter to the caller and up to `num_threads - 1` others (pool.h).
 *
 * Built by runtime/paged_decode.py with `cc -O3 -march=native -ffp-contract=fast` (no
 * -ffast-math: IEEE semantics everywhere but FMA contraction); called through ctypes, which releases
 * the GIL. Returns 0, or a negative code for arguments it refuses.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

#define MAX_GROUP 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define MAX_THREADS 64

typedef struct job job_t;
struct job {
    const void *q, *k, *v;
    const int32_t *tables, *lens;
    void *out;
    int64_t table_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t bf16;
    void (*unit)(job_t *, int64_t); /* pool.h's interface: unit u of `units`, handed out through `next` */
    int64_t units;
    atomic_long next;
};

/* 8 floats; aligned(4) lets it load from any float address. GCC/Clang lower it to AVX (or SSE pairs). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8v __attribute__((vector_size(32)));

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* Pairwise sums within each 128-bit half (what AVX's vhaddps does). */
static inline v8 hadd8(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* {Σa0, Σa1, …, Σa7}: eight horizontal sums in seven adds. */
static inline v8 reduce8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
    const v8 u0 = hadd8(hadd8(a0, a1), hadd8(a2, a3));
    const v8 u1 = hadd8(hadd8(a4, a5), hadd8(a6, a7));
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* e^x for x <= 0 (scores minus their running max), 8 lanes: 2^n · p(r), n = round(x / ln2), r = x - n·ln2
 * (ln2 split in two for an exact product), p the degree-6 Taylor polynomial: relative error ~2e-7,
 * float32's own rounding. Inputs below -87 are clamped, so e^-inf gives ~1e-38 instead of 0. */
static inline v8 exp_v8(v8 x) {
    const v8 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const i8v below = x < lo;
    x = (v8)((below & (i8v)lo) | (~below & (i8v)x));
    /* round to nearest by the 1.5·2^23 trick: exact under the default rounding mode */
    const v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const v8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    v8 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i8v e = (__builtin_convertvector(n, i8v) + 127) << 23;
    return p * (v8)e;
}

/* acc[0..8) = acc · corr + Σ_t p[t] · v_t[0..8): eight independent chains, so the adds do not wait
 * on each other (one chain over t would be bound by the add latency). */
static inline void pv_chunk8(v8 *acc, float corr, const float *p, const float *v, int64_t n, int64_t stride) {
    v8 r0 = acc[0] * corr, r1 = acc[1] * corr, r2 = acc[2] * corr, r3 = acc[3] * corr;
    v8 r4 = acc[4] * corr, r5 = acc[5] * corr, r6 = acc[6] * corr, r7 = acc[7] * corr;
    for (int64_t t = 0; t < n; t++) {
        const v8 *vt = (const v8 *)(v + t * stride);
        const float w = p[t];
        r0 += w * vt[0];
        r1 += w * vt[1];
        r2 += w * vt[2];
        r3 += w * vt[3];
        r4 += w * vt[4];
        r5 += w * vt[5];
        r6 += w * vt[6];
        r7 += w * vt[7];
    }
    acc[0] = r0, acc[1] = r1, acc[2] = r2, acc[3] = r3;
    acc[4] = r4, acc[5] = r5, acc[6] = r6, acc[7] = r7;
}

/* scores[t] = scale · q · k_t for the n tokens at k (row stride `stride`), nv vectors per row. */
static inline void qk_scores(float *scores, const v8 *q, const float *k, int64_t n, int64_t nv, int64_t stride,
                             float scale) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const float *kt = k + t * stride;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (int64_t i = 0; i < nv; i++) {
            const v8 qi = q[i];
            a0 += qi * ((const v8 *)(kt + 0 * stride))[i];
            a1 += qi * ((const v8 *)(kt + 1 * stride))[i];
            a2 += qi * ((const v8 *)(kt + 2 * stride))[i];
            a3 += qi * ((const v8 *)(kt + 3 * stride))[i];
            a4 += qi * ((const v8 *)(kt + 4 * stride))[i];
            a5 += qi * ((const v8 *)(kt + 5 * stride))[i];
            a6 += qi * ((const v8 *)(kt + 6 * stride))[i];
            a7 += qi * ((const v8 *)(kt + 7 * stride))[i];
        }
        *(v8 *)(scores + t) = reduce8(a0, a1, a2, a3, a4, a5, a6, a7) * scale;
    }
    for (; t < n; t++) {
        const v8 *kt = (const v8 *)(k + t * stride);
        v8 a = {0};
        for (int64_t i = 0; i < nv; i++) a += q[i] * kt[i];
        scores[t] = hsum(a) * scale;
    }
}

typedef uint16_t h8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u8v __attribute__((vector_size(32)));

/* n rows of D bfloat16 values (row stride `stride`) → float32 rows of D, packed. D % 8 == 0. */
static void widen(float *dst, const uint16_t *src, int64_t n, int64_t D, int64_t stride) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t d = 0; d < D; d += 8)
            *(v8 *)(dst + t * D + d) = (v8)(__builtin_convertvector(*(const h8 *)(src + t * stride + d), u8v) << 16);
}


/* scratch: 2 · MAX_BLOCK · MAX_HEAD_DIM floats for a bf16 block's keys and values, and the group's q. */
static void run_unit(const job_t *j, int64_t unit, float *scores, float *acc, float *scratch) {
    const int64_t s = unit / j->num_kv_heads, kh = unit % j->num_kv_heads;
    const int64_t G = j->num_heads / j->num_kv_heads, D = j->head_dim, BS = j->block_size;
    const int64_t nv = D / 8; /* head_dim % 8 == 0, checked by the caller */
    const int64_t tok_stride = j->num_kv_heads * D;
    const int64_t len = j->lens[s];
    const int64_t q0 = (s * j->num_heads + kh * G) * D; /* the group's first query element */
    float *kw = scratch, *vw = scratch + MAX_BLOCK * MAX_HEAD_DIM, *qw = vw + MAX_BLOCK * MAX_HEAD_DIM;
    const float *qg = (const float *)j->q + q0;
    if (j->bf16) {
        widen(qw, (const uint16_t *)j->q + q0, G, D, D);
        qg = qw;
    }
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * G * D);
    const int64_t n_blocks = (len + BS - 1) / BS;
    for (int64_t b = 0; b < n_blocks; b++) {
        const int64_t blk = j->tables[s * j->table_stride + b];
        const int64_t n = (len - b * BS) < BS ? (len - b * BS) : BS;
        const int64_t at = blk * BS * tok_stride + kh * D;
        const float *kb = (const float *)j->k + at, *vb = (const float *)j->v + at;
        int64_t stride = tok_stride;
        if (j->bf16) {
            widen(kw, (const uint16_t *)j->k + at, n, D, tok_stride);
            widen(vw, (const uint16_t *)j->v + at, n, D, tok_stride);
            kb = kw, vb = vw, stride = D;
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = scores + g * BS;
            qk_scores(sg, (const v8 *)(qg + g * D), kb, n, nv, stride, j->scale);
            /* online softmax: rescale what was accumulated when the running max grows, then add p · v */
            float bm = sg[0];
            for (int64_t t = 1; t < n; t++) bm = sg[t] > bm ? sg[t] : bm;
            const float nm = bm > m[g] ? bm : m[g];
            const float corr = expf(m[g] - nm); /* m = -inf on the first block: corr = 0 */
            float sum = 0.0f;
            int64_t t = 0;
            for (; t + 8 <= n; t += 8) {
                const v8 e = exp_v8(*(v8 *)(sg + t) - nm);
                *(v8 *)(sg + t) = e;
                sum += hsum(e);
            }
            for (; t < n; t++) {
                sg[t] = expf(sg[t] - nm);
                sum += sg[t];
            }
            l[g] = l[g] * corr + sum;
            m[g] = nm;
            v8 *ag = (v8 *)(acc + g * D);
            int64_t i = 0;
            for (; i + 8 <= nv; i += 8) pv_chunk8(ag + i, corr, sg, vb + i * 8, n, stride);
            for (; i < nv; i++) {
                v8 r = ag[i] * corr;
                for (int64_t u = 0; u < n; u++) r += sg[u] * ((const v8 *)(vb + u * stride))[i];
                ag[i] = r;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        /* len == 0 cannot happen for a scheduled decode (it includes the new token); guard anyway */
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        if (j->bf16) {
            uint16_t *og = (uint16_t *)j->out + q0 + g * D;
            for (int64_t d = 0; d < D; d++) og[d] = f32_to_bf16(acc[g * D + d] * inv);
        } else {
            float *og = (float *)j->out + q0 + g * D;
            for (int64_t d = 0; d < D; d++) og[d] = acc[g * D + d] * inv;
        }
    }
}

/* One (sequence, KV head) unit, on the pool's or torch's OpenMP threads. */
static void decode_unit(job_t *j, int64_t u) {
    static _Thread_local float scores[MAX_GROUP * MAX_BLOCK], acc[MAX_GROUP * MAX_HEAD_DIM];
    static _Thread_local float scratch[2 * MAX_BLOCK * MAX_HEAD_DIM + MAX_GROUP * MAX_HEAD_DIM]
        __attribute__((aligned(32))); /* 576 KB: per thread, not on the stack */
    run_unit(j, u, scores, acc, scratch);
}

#include "pool.h"

static int paged_decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *context_lens, void *out, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int64_t num_threads, int64_t bf16) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return -1;
    if (num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK) return -2;
    if (head_dim % 8) return -3;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    const int64_t units = num_seqs * num_kv_heads;
    if (num_threads > units) num_threads = units;
    job_t j = {q, k_cache, v_cache, block_tables, context_lens, out, table_stride, num_seqs, num_heads,
               num_kv_heads, head_dim, block_size, scale, bf16, decode_unit, units, 0};
    atomic_init(&j.next, 0);
    pool_t *pool = &pools[0];
    pthread_mutex_lock(&pool->call);
    dispatch(pool, &j, num_threads);
    pthread_mutex_unlock(&pool->call);
    return 0;
}

int vlm_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *context_lens, float *out, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         int64_t num_threads) {
    return paged_decode(q, k_cache, v_cache, block_tables, table_stride, context_lens, out, num_seqs, num_heads,
                        num_kv_heads, head_dim, block_size, scale, num_threads, 0);
}

int vlm_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens,
                          uint16_t *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, int64_t num_threads) {
    return paged_decode(q, k_cache, v_cache, block_tables, table_stride, context_lens, out, num_seqs, num_heads,
                        num_kv_heads, head_dim, block_size, scale, num_threads, 1);
}
