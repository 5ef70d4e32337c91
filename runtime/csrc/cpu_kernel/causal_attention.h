/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- causal attention: a decoder's prefill */

/* A chunk of lq query rows that ends an lk-token context (query row r sits at position lk - lq + r and sees keys
 * 0 … lk - lq + r), grouped-query heads (query head h reads kv head h / (heads / kv_heads)), bfloat16 in and out,
 * products as bf16 dot products over 16 query rows in lanes as in attend_unit_dot. No rotary: the decoder
 * applies its own before the keys are cached. Rows are given with their own strides (elements), heads packed
 * in each row. Built where the compiler targets AVX512-BF16; elsewhere the entry point refuses (-6) and the
 * caller keeps torch's attention. */
#if HAVE_BF16DOT
typedef struct {
    job_t base; /* units / next / unit, and d, heads, scale2 */
    const uint16_t *q, *k, *v;
    uint16_t *out;
    int64_t qs, ks, vs, os; /* row strides */
    int64_t lq, lk, kv_heads, group;
    int64_t pq, pk, qchunks, kchunks; /* rows padded to 64, and 64-row chunks */
    int64_t amx, dq;                  /* AMX tiles for the products; q and k rows padded to dq dims */
    uint16_t *qp, *kp, *vp; /* q [heads][pq rows] in 16-row tiles; k [kv_heads][pk rows] in 16-row tiles and v in
                             * key pairs, or on AMX k as rows and v per 64-key block [D][64] (as attend_unit_amx) */
} causal_job_t;

/* Row `row` of x (d values) into tiles of 16 rows [dq/2][16][2], dims d … dq zero. */
static inline void put_tile(uint16_t *tiles, int64_t row, int64_t d, int64_t dq, const uint16_t *x) {
    uint16_t *dst = tiles + (row / 16 * 16) * dq + (row % 16) * 2;
    for (int64_t e = 0; e < dq; e += 2) {
        if (e < d) memcpy(dst + e * 16, x + e, 4);
        else memset(dst + e * 16, 0, 4);
    }
}

/* Units [0, qchunks): 64 query rows, every head; then 64 key rows, every kv head. Rows past the end are zeros. */
static void causal_pack_unit(job_t *jb, int64_t u) {
    causal_job_t *j = (causal_job_t *)jb;
    const int64_t d = jb->d, dq = j->dq;
    static const uint16_t zeros[MAX_D];
    if (u < j->qchunks) {
        for (int64_t r = u * QB; r < (u + 1) * QB; r++)
            for (int64_t h = 0; h < jb->heads; h++)
                put_tile(j->qp + h * j->pq * dq, r, d, dq, r < j->lq ? j->q + r * j->qs + h * d : zeros);
        return;
    }
    u -= j->qchunks;
    for (int64_t r = u * QB; r < (u + 1) * QB; r++)
        for (int64_t g = 0; g < j->kv_heads; g++) {
            const uint16_t *k = r < j->lk ? j->k + r * j->ks + g * d : zeros;
            const uint16_t *v = r < j->lk ? j->v + r * j->vs + g * d : zeros;
            if (j->amx) {
                uint16_t *kr = j->kp + (g * j->pk + r) * dq, *vt = j->vp + (g * j->pk + r / KB * KB) * d + r % KB;
                memcpy(kr, k, (size_t)d * 2);
                memset(kr + d, 0, (size_t)(dq - d) * 2);
                for (int64_t e = 0; e < d; e++) vt[e * KB] = v[e];
            } else {
                put_tile(j->kp + g * j->pk * d, r, d, d, k);
                uint16_t *dst = j->vp + (g * j->pk + r / 2 * 2) * d + r % 2;
                for (int64_t e = 0; e < d; e++) dst[e * 2] = v[e];
            }
        }
}

/* Unit u: one head's 64 query rows, the chunks with the most keys first (units are taken in order). */
static void causal_unit(job_t *jb, int64_t u) {
    const causal_job_t *j = (const causal_job_t *)jb;
    const int64_t d = jb->d, heads = jb->heads;
    const int64_t c = j->qchunks - 1 - u / heads, h = u % heads, g = h / j->group;
    const int64_t r0 = c * QB, rows = j->lq - r0 < QB ? j->lq - r0 : QB, tiles = (rows + TR - 1) / TR;
    const int64_t pos0 = j->lk - j->lq + r0; /* position of the unit's first row */
    float Ot[(QB / TR) * MAX_D * TR] __attribute__((aligned(64)));
    __m512 S[KB], m[QB / TR], l[QB / TR];
    __m512i P[KB / 2];
    __mmask16 valid[KB];
    memset(Ot, 0, sizeof(float) * (size_t)(tiles * d * TR));
    for (int64_t t = 0; t < tiles; t++) m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
    const uint16_t *kt = j->kp + g * j->pk * d, *vt = j->vp + g * j->pk * d;
    const int64_t kend = pos0 + rows; /* keys the unit's last row sees */
    for (int64_t k0 = 0; k0 < kend; k0 += KB) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = pos0 + t * TR, tile_rows = rows - t * TR < TR ? rows - t * TR : TR;
            const int64_t last = first + tile_rows - 1;
            if (k0 > last) continue; /* every key of the block is after every row of the tile */
            const int64_t kv = last + 1 - k0 < KB ? last + 1 - k0 : KB;
            const uint16_t *qt = j->qp + (h * j->pq + r0 + t * TR) * d;
            for (int64_t k1 = 0; k1 < kv; k1 += 16) qk_tile(qt, kt + (k0 + k1) * d, d, S + k1);
            const int diagonal = k0 + kv - 1 > first;
            if (diagonal)
                for (int64_t i = 0; i < kv; i++) { /* lanes r with first + r >= k0 + i */
                    const int64_t skip = k0 + i - first;
                    valid[i] = skip <= 0 ? (__mmask16)0xffff : (__mmask16)(0xffffu << skip);
                }
            const __m512 corr = softmax_tile(S, kv, diagonal ? valid : NULL, jb->scale2, m + t, l + t, P, 0);
            for (int64_t d0 = 0; d0 < d; d0 += 16)
                pv_tile(P, (kv + 1) / 2, vt + k0 * d, d, d0, Ot + t * d * TR, corr);
        }
    }
    write_tiles(Ot, l, d, rows, j->out + r0 * j->os + h * d, j->os);
}

#if HAVE_AMX
/* causal_unit with the products on AMX tiles, as attend_unit_amx (the scores of all 64 keys of a block are
 * computed; the softmax reads the first kv). */
static void causal_unit_amx(job_t *jb, int64_t u) {
    const causal_job_t *j = (const causal_job_t *)jb;
    const int64_t d = jb->d, dq = j->dq, heads = jb->heads;
    const int64_t c = j->qchunks - 1 - u / heads, h = u % heads, g = h / j->group;
    const int64_t r0 = c * QB, rows = j->lq - r0 < QB ? j->lq - r0 : QB, tiles = (rows + TR - 1) / TR;
    const int64_t pos0 = j->lk - j->lq + r0; /* position of the unit's first row */
    float Ots[(QB / TR) * MAX_D * TR] __attribute__((aligned(64)));
    __m512 m[QB / TR], l[QB / TR];
    __mmask16 valid[KB];
    for (int64_t t = 0; t < tiles; t++) m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
    amx_config(); /* each tile's accumulators are written on its first block (k0 = 0), not zeroed here */
    const uint16_t *kt = j->kp + g * j->pk * dq, *vt = j->vp + g * j->pk * d;
    const int64_t kend = pos0 + rows; /* keys the unit's last row sees */
    for (int64_t k0 = 0; k0 < kend; k0 += KB) { /* k0 + 64 <= pk: all four key tiles of a block exist */
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = pos0 + t * TR, tile_rows = rows - t * TR < TR ? rows - t * TR : TR;
            const int64_t last = first + tile_rows - 1;
            if (k0 > last) continue; /* every key of the block is after every row of the tile */
            const int64_t kv = last + 1 - k0 < KB ? last + 1 - k0 : KB;
            const int diagonal = k0 + kv - 1 > first;
            if (diagonal)
                for (int64_t i = 0; i < kv; i++) { /* lanes r with first + r >= k0 + i */
                    const int64_t skip = k0 + i - first;
                    valid[i] = skip <= 0 ? (__mmask16)0xffff : (__mmask16)(0xffffu << skip);
                }
            amx_step(j->qp + (h * j->pq + r0 + t * TR) * dq, kt + k0 * dq, vt + k0 * d, d, dq, kv,
                     diagonal ? valid : NULL, jb->scale2, m + t, l + t, Ots + t * d * TR, k0 == 0, 0);
        }
    }
    _tile_release();
    write_tiles(Ots, l, d, rows, j->out + r0 * j->os + h * d, j->os);
}
#endif

#endif

int vlm_causal_attention(const void *q, const void *k, const void *v, void *out, int64_t lq, int64_t lk,
                         int64_t heads, int64_t kv_heads, int64_t d, int64_t q_stride, int64_t k_stride,
                         int64_t v_stride, int64_t out_stride, float scale, int64_t threads, int64_t amx) {
    if (d <= 0 || d % 16 || d > MAX_D) return -1;
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || lq < 0 || lk < lq) return -3;
#if !HAVE_BF16DOT
    (void)q, (void)k, (void)v, (void)out, (void)q_stride, (void)k_stride, (void)v_stride, (void)out_stride;
    (void)scale, (void)threads, (void)amx;
    return -6;
#else
    if (amx && !vlm_amx_ready()) return -6;
    if (lq == 0) return 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    causal_job_t j;
    memset(&j, 0, sizeof j);
    j.base.d = d, j.base.heads = heads, j.base.scale2 = scale * 1.4426950408889634f;
    j.q = q, j.k = k, j.v = v, j.out = out;
    j.qs = q_stride, j.ks = k_stride, j.vs = v_stride, j.os = out_stride;
    j.lq = lq, j.lk = lk, j.kv_heads = kv_heads, j.group = heads / kv_heads;
    j.qchunks = (lq + QB - 1) / QB, j.kchunks = (lk + QB - 1) / QB;
    j.pq = j.qchunks * QB, j.pk = j.kchunks * QB;
    j.amx = amx != 0, j.dq = amx ? (d + 31) / 32 * 32 : d;
    const size_t qbytes = (size_t)(heads * j.pq * j.dq) * 2, kbytes = (size_t)(kv_heads * j.pk * j.dq) * 2;
    const size_t vbytes = (size_t)(kv_heads * j.pk * d) * 2;
    pool_t *pool = &pools[PREFILL_POOL];
    pthread_mutex_lock(&pool->call);
    uint16_t *buf = scratch_get(pool, qbytes + kbytes + vbytes);
    int rc = buf ? 0 : -4;
    if (rc == 0) { /* every size a multiple of 64 rows × 16 dims × 2 bytes: the three stay 64-byte aligned */
        j.qp = buf, j.kp = buf + qbytes / 2, j.vp = buf + (qbytes + kbytes) / 2;
        j.base.units = j.qchunks + j.kchunks;
        j.base.unit = causal_pack_unit;
        dispatch(pool, &j.base, threads);
        j.base.units = j.qchunks * heads;
#if HAVE_AMX
        j.base.unit = j.amx ? causal_unit_amx : causal_unit;
#else
        j.base.unit = causal_unit;
#endif
        dispatch(pool, &j.base, threads);
    }
    scratch_done(pool);
    pthread_mutex_unlock(&pool->call);
    return rc;
#endif
}
