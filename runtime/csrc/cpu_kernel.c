/* The runtime's compute kernels for the towers and the decoder (cpu_kernel.so). First, varlen self-attention for vision towers on the CPU: every segment (an image, or a window of one) of a
 * packed batch attends within itself; no padding to the longest segment, no score matrix in memory.
 *
 * In: qkv [N, 3, H, D] (float32 or bfloat16, the qkv projection's rows), optional rotary tables cos/sin
 * [N, D/2] float32, cu_seqlens [S + 1] int32. Out: [N, H, D] in the input dtype.
 *
 * Two phases over a thread pool. Pack: per 64-row chunk of a segment (every head: rows of qkv are read in
 * order) apply the rotary to q and k in float32, round to the input dtype (as transformers does) and lay q, k,
 * v out for the products, each segment padded with zero rows to a multiple of 64. Attend: per (segment, head,
 * 64 query rows) a flash loop over 64-key blocks with an online softmax in float32 (exp2 of scores
 * pre-multiplied by scale·log2 e) and no score matrix in memory.
 *
 * Where the compiler targets AVX512-BF16 (-march=native on such a CPU) and the input is bfloat16, both
 * products are bf16 dot products (vdpbf16ps, float32 accumulation) over tiles of 16 query rows held in the
 * lanes (see attend_unit_dot), P rounded to bfloat16 as flash attention does; on a CPU with AMX-BF16, and
 * where the caller asks for it (`amx`), the same products run as tile products on the same layouts (see
 * attend_unit_amx). Else they are float32 FMAs: with AVX2 (no AVX-512) on 6 × 16 register tiles that hold
 * 16 query rows in the lanes (see attend_t; segments of at most 64 rows are packed and attended in one unit,
 * attend_short_t, as the bf16 paths do); elsewhere on GCC vectors (16 lanes with AVX-512) over 4 query
 * rows × 4 vectors of keys in registers, the flash loop stepping by 4 vectors of keys (KS).
 *
 * The same library holds the MLP's bias + quick-GELU as one in-place pass (vlm_bias_quick_gelu), so the tower's
 * compiled path shares one thread pool.
 *
 * Its sections are the files of cpu_kernel/, included below in order (one translation unit); the thread
 * pool is pool.h, shared with paged_decode.c. Built by runtime/cpu_kernel.py with `cc -O3 -march=native -ffp-contract=fast`; called through
 * ctypes, which releases the GIL. Returns 0, or a negative code for arguments it refuses.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

#if defined(__AVX512F__)
#define VW 16
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#define LANE0 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
#else
#define VW 8
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7}
#define LANE0 0, 0, 0, 0, 0, 0, 0, 0
#endif

/* The float32 products with 8 lanes (AVX2 + FMA, no AVX-512) hold query rows in the lanes (see attend_t). */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ROWS_IN_LANES 1
#else
#define ROWS_IN_LANES 0
#endif

#define QB 64 /* query rows per unit of work, and the row padding of every segment */
#define KB 64 /* keys per block */
#define SHORT_DQ 128 /* the widest padded head dim attend_short_amx and attend_short_dot pack on their stacks */

#define RT 4  /* query rows per register tile of the float32 products */
#define MAX_D 256
#define MAX_THREADS 64

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));

#include "cpu_kernel/vectors.h"
#include "cpu_kernel/attention_job.h"
#include "cpu_kernel/attention_products.h"
#include "cpu_kernel/attention_unit.h"
/* two pools: the decoder's prefill (an engine step) never waits for a vision tower's call on another thread, nor
 * the reverse */
enum { VISION_POOL, PREFILL_POOL };
#define POOLS 2
#include "pool.h"
#include "cpu_kernel/mlp_activation.h"
#include "cpu_kernel/rms_norm.h"
#include "cpu_kernel/layer_norm.h"
#include "cpu_kernel/silu_mul.h"
#include "cpu_kernel/rope_heads.h"
#include "cpu_kernel/decode_layer.h"
#include "cpu_kernel/causal_attention.h"
#include "cpu_kernel/linear_f32.h"

/* ---------------------------------------------------------------- entry points */

const char *vlm_varlen_attention_isa(void) { return HAVE_BF16DOT ? "avx512-bf16" : "fp32-fma"; }

/* Segment offsets and the packed buffers (from the pool's scratch: the caller holds pool->call). */
static int plan(job_t *j, int64_t n, pool_t *pool) {
    j->pad = malloc(sizeof(int64_t) * (size_t)(2 * (j->segs + 1)));
    if (!j->pad) return -4;
    j->chunk = j->pad + j->segs + 1;
    j->pad[0] = j->chunk[0] = 0;
    for (int64_t s = 0; s < j->segs; s++) {
        const int64_t len = (int64_t)j->cu[s + 1] - j->cu[s];
        if (len < 0 || j->cu[s + 1] > n) return -5;
        const int64_t chunks = (len + QB - 1) / QB;
        j->pad[s + 1] = j->pad[s] + chunks * QB;
        j->chunk[s + 1] = j->chunk[s] + chunks;
    }
    j->padded = j->pad[j->segs];
    /* multiples of 64 rows × 16 dims × 2 bytes: the three stay 64-byte aligned */
    const size_t bytes = (size_t)(j->heads * j->padded * j->d) * (j->dot ? 2 : 4);
    const size_t qk_bytes = (size_t)(j->heads * j->padded * j->dq) * (j->dot ? 2 : 4);
    char *buf = scratch_get(pool, 2 * qk_bytes + bytes);
    if (!buf) return -4;
    j->qp = buf, j->kp = buf + qk_bytes, j->vp = buf + 2 * qk_bytes;
    return 0;
}

int vlm_varlen_attention(const void *qkv, const float *cos, const float *sin, const int32_t *cu, int64_t segs,
                         void *out, int64_t n, int64_t heads, int64_t d, int64_t dtype, float scale, int64_t threads,
                         int64_t amx) {
    if (d <= 0 || d % 16 || d > MAX_D) return -1;
    if (dtype != 0 && dtype != 1) return -2;
    if (segs < 0 || heads <= 0 || n < 0 || (cos == NULL) != (sin == NULL)) return -3;
    if (amx && (dtype != 1 || !vlm_amx_ready())) return -6;
    if (segs == 0 || n == 0) return 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    job_t j = {qkv, cos, sin, cu, out, segs, heads, d, dtype == 1, HAVE_BF16DOT && dtype == 1, 0, amx != 0,
               amx ? (d + 31) / 32 * 32 : d, scale * 1.4426950408889634f, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0};
    pool_t *pool = &pools[VISION_POOL];
    pthread_mutex_lock(&pool->call);
    int rc = plan(&j, n, pool);
    if (rc == 0) {
        j.units = j.chunk[segs];
#if HAVE_BF16DOT
        j.unit = j.dot ? pack_unit_bf16 : pack_unit;
#else
        j.unit = pack_unit;
#endif
        dispatch(pool, &j, threads);
        j.units = j.chunk[segs] * heads;
        j.unit = attend_unit;
        dispatch(pool, &j, threads);
    }
    scratch_done(pool);
    pthread_mutex_unlock(&pool->call);
    free(j.pad);
    return rc;
}
