/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- float32 linear layers (AVX2)
 *
 * y [M, N] = x [M, K] · wᵀ + bias, with w packed once into panels of 16 output columns [N/16][K][16] (zero
 * columns past N). The same 6 × 16 register tile as the attention's products: per k, two vector loads of the
 * panel and six broadcasts of x's rows (x is not packed: its rows are read in place), 12 FMAs. Blocked for the
 * caches: a unit is GMC rows × a run of panels; within it the K dimension goes in steps of GKC so that a
 * panel's [GKC][16] slice (32 KB) stays near L1 for all GMC / 6 row tiles and the rows' [GMC][GKC] slice
 * (288 KB) in L2 for all panels. The first K step starts from the bias, the later ones add to y.
 *
 * GMC and GKC measured on a 2-vCPU Zen 3 (2 threads, best of 7 alternating, the towers' and the decoder's shapes
 * at 512-4,096 rows): 144 × 512 and 96 × 384 were the best pair (0.98-1.2× torch's MKL sgemm), 96 × 256 was
 * 0.74-1.12×; at 8-64 rows (decode) 1.2-2.4× (benchmarks/README.md). */
#if ROWS_IN_LANES
#ifndef GMC
#define GMC 144 /* rows per unit (a multiple of 6) */
#endif
#ifndef GKC
#define GKC 512 /* K per step */
#endif
#ifndef GCHAIN
#define GCHAIN 256 /* K per register chain (see gemm_tile) */
#endif

typedef struct {
    job_t base; /* only units / next / unit are used */
    const float *x, *wp, *bias;
    float *y;
    int64_t m, n, k, ldx, ldy, mc, panels, per_unit, n_units;
} gemm_job_t;

/* NOTE: each output's sum runs in chains of GCHAIN products, each started from zero and then added to the tile's
 * total in y. One chain over all of K (before 2026-12-04) rounded like one K-term sum: 0.9-5.6x torch's error
 * against float64 at K 384-4,096 (max over 256 × 512 outputs; x86-64-v3 build on a 2-vCPU AMX Xeon, torch's
 * oneDNN sgemm); chains of 256: 0.7-0.95x torch's at the same speed (0.97-1.01x, 16-4,096 rows, best of 9
 * alternating). Chains of 64 were 3-8x more exact than one chain but 5-22 % slower, of 128 0-14 % slower. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t ldx, const float *wp, int64_t kc,
                                                            float *y, int64_t ldy, const float *init, int add,
                                                            const int R) {
    if (!add)
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(y + r * ldy, _mm256_loadu_ps(init));
            _mm256_storeu_ps(y + r * ldy + 8, _mm256_loadu_ps(init + 8));
        }
    for (int64_t e0 = 0; e0 < kc; e0 += GCHAIN) {
        const int64_t e1 = kc - e0 < GCHAIN ? kc : e0 + GCHAIN;
        __m256 a[6][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t e = e0; e < e1; e++) {
            __m256 b0 = _mm256_load_ps(wp + e * 16), b1 = _mm256_load_ps(wp + e * 16 + 8);
            __asm__("" : "+x"(b0), "+x"(b1)); /* in registers for all R rows, as in qk_t */
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                const __m256 b = _mm256_broadcast_ss(x + r * ldx + e);
                a[r][0] = _mm256_fmadd_ps(b, b0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(b, b1, a[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(_mm256_loadu_ps(y + r * ldy), a[r][0]));
            _mm256_storeu_ps(y + r * ldy + 8, _mm256_add_ps(_mm256_loadu_ps(y + r * ldy + 8), a[r][1]));
        }
    }
}

/* Rows i .. i + rows (<= 6) of one panel over one K step; y points at the tile's first element (16 columns,
 * or a scratch tile where the panel is past N's end). */
static void gemm_rows(const float *x, int64_t ldx, const float *wp, int64_t kc, float *y, int64_t ldy,
                      const float *init, int add, int64_t rows) {
    switch (rows) {
    case 6: gemm_tile(x, ldx, wp, kc, y, ldy, init, add, 6); break;
    case 5: gemm_tile(x, ldx, wp, kc, y, ldy, init, add, 5); break;
    case 4: gemm_tile(x, ldx, wp, kc, y, ldy, init, add, 4); break;
    case 3: gemm_tile(x, ldx, wp, kc, y, ldy, init, add, 3); break;
    case 2: gemm_tile(x, ldx, wp, kc, y, ldy, init, add, 2); break;
    default: gemm_tile(x, ldx, wp, kc, y, ldy, init, add, 1); break;
    }
}

/* Unit u's rows [m0, m1) and panels [p0, p1) (see plan_gemm). */
static inline void gemm_range(const gemm_job_t *g, int64_t u, int64_t *m0, int64_t *m1, int64_t *p0, int64_t *p1) {
    *m0 = (u / g->n_units) * g->mc;
    *m1 = *m0 + g->mc < g->m ? *m0 + g->mc : g->m;
    *p0 = (u % g->n_units) * g->per_unit;
    *p1 = *p0 + g->per_unit < g->panels ? *p0 + g->per_unit : g->panels;
}

static void gemm_unit(job_t *jb, int64_t u) {
    const gemm_job_t *g = (const gemm_job_t *)jb;
    int64_t m0, m1, p0, p1;
    gemm_range(g, u, &m0, &m1, &p0, &p1);
    for (int64_t k0 = 0; k0 < g->k; k0 += GKC) {
        const int64_t kc = g->k - k0 < GKC ? g->k - k0 : GKC;
        for (int64_t p = p0; p < p1; p++) {
            const float *wp = g->wp + (p * g->k + k0) * 16;
            const int64_t c0 = p * 16, cols = g->n - c0 < 16 ? g->n - c0 : 16;
            float init[16] __attribute__((aligned(32))) = {0};
            if (k0 == 0 && g->bias)
                for (int64_t c = 0; c < cols; c++) init[c] = g->bias[c0 + c];
            for (int64_t i = m0; i < m1; i += 6) {
                const int64_t rows = m1 - i < 6 ? m1 - i : 6;
                const float *x = g->x + i * g->ldx + k0;
                if (cols == 16) {
                    gemm_rows(x, g->ldx, wp, kc, g->y + i * g->ldy + c0, g->ldy, init, k0 > 0, rows);
                    continue;
                }
                float tile[6 * 16] __attribute__((aligned(32)));
                for (int64_t r = 0; r < rows && k0 > 0; r++)
                    for (int64_t c = 0; c < cols; c++) tile[r * 16 + c] = g->y[(i + r) * g->ldy + c0 + c];
                gemm_rows(x, g->ldx, wp, kc, tile, 16, init, k0 > 0, rows);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = 0; c < cols; c++) g->y[(i + r) * g->ldy + c0 + c] = tile[r * 16 + c];
            }
        }
    }
}

/* The gated MLP's two projections and its silu(gate) · up in one pass: the gate's job (wp, bias) and the up
 * projection's weight and bias; the output holds only the product, never the two [m, n] projections. */
typedef struct {
    gemm_job_t g;
    const float *wu, *bu;
} glu_job_t;

/* Per row tile and panel, the gate's and the up projection's 6 × 16 tiles over every K step in stack scratch
 * (the same tiles and order as gemm_unit's, so each projection equals vlm_linear's to the bit), then
 * silu(gate) · up on 8 lanes (y_sigmoid_v, as vlm_silu_mul's vectors) into y. */
static void glu_unit(job_t *jb, int64_t u) {
    const glu_job_t *q = (const glu_job_t *)jb;
    const gemm_job_t *g = &q->g;
    int64_t m0, m1, p0, p1;
    gemm_range(g, u, &m0, &m1, &p0, &p1);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t c0 = p * 16, cols = g->n - c0 < 16 ? g->n - c0 : 16;
        float ig[16] __attribute__((aligned(32))) = {0}, iu[16] __attribute__((aligned(32))) = {0};
        for (int64_t c = 0; c < cols; c++) {
            if (g->bias) ig[c] = g->bias[c0 + c];
            if (q->bu) iu[c] = q->bu[c0 + c];
        }
        for (int64_t i = m0; i < m1; i += 6) {
            const int64_t rows = m1 - i < 6 ? m1 - i : 6;
            float tg[6 * 16] __attribute__((aligned(32))), tu[6 * 16] __attribute__((aligned(32)));
            for (int64_t k0 = 0; k0 < g->k; k0 += GKC) {
                const int64_t kc = g->k - k0 < GKC ? g->k - k0 : GKC;
                const float *x = g->x + i * g->ldx + k0;
                gemm_rows(x, g->ldx, g->wp + (p * g->k + k0) * 16, kc, tg, 16, ig, k0 > 0, rows);
                gemm_rows(x, g->ldx, q->wu + (p * g->k + k0) * 16, kc, tu, 16, iu, k0 > 0, rows);
            }
            for (int64_t r = 0; r < rows; r++) {
                float *y = g->y + (i + r) * g->ldy + c0;
                for (int64_t h = 0; h < 16; h += 8) {
                    const vf out = y_sigmoid_v(*(const vf *)(tg + r * 16 + h), 1.0f) * *(const vf *)(tu + r * 16 + h);
                    if (h + 8 <= cols) *(vf_at *)(y + h) = out;
                    else
                        for (int64_t c = h; c < cols; c++) y[c] = out[c - h];
                }
            }
        }
    }
}

/* Units for an [m, n] product on `threads`: row blocks of at most GMC rows, as many as a multiple of the threads
 * and of equal size (a multiple of 6). NOTE: 1,024 rows in blocks of 144 left one thread 576 rows and the other
 * 448. A matrix of one block (decode) is split by panels alone: each row block reads every panel of the weight. */
static void plan_gemm(gemm_job_t *g, int64_t threads) {
    g->panels = (g->n + 15) / 16;
    int64_t row_units = (g->m + GMC - 1) / GMC;
    if (row_units > 1) row_units = (row_units + threads - 1) / threads * threads;
    g->mc = ((g->m + row_units - 1) / row_units + 5) / 6 * 6;
    row_units = (g->m + g->mc - 1) / g->mc;
    int64_t split = (4 * threads + row_units - 1) / row_units; /* panel runs per row block: >= 4 units a thread */
    if (split > g->panels) split = g->panels;
    g->per_unit = (g->panels + split - 1) / split;
    g->n_units = (g->panels + g->per_unit - 1) / g->per_unit;
    g->base.units = row_units * g->n_units;
}

/* A product's job (its shape set, `unit` its kind) checked, planned and run on pool `pool_id`; -1 for a shape or
 * pool the entry points refuse. */
static int run_gemm(gemm_job_t *g, void (*unit)(job_t *, int64_t), int64_t threads, int64_t pool_id) {
    if (g->m < 0 || g->n <= 0 || g->k <= 0 || g->ldx < g->k || g->ldy < g->n || pool_id < 0 || pool_id >= POOLS)
        return -1;
    if (g->m == 0) return 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    plan_gemm(g, threads);
    g->base.unit = unit;
    pool_t *pool = &pools[pool_id];
    pthread_mutex_lock(&pool->call);
    dispatch(pool, &g->base, threads);
    pthread_mutex_unlock(&pool->call);
    return 0;
}
#endif

/* Floats the packed weight of an [n, k] linear layer takes (0 where this build has no float32 linear). */
int64_t vlm_linear_packed_size(int64_t n, int64_t k) {
#if ROWS_IN_LANES
    return (n + 15) / 16 * 16 * k;
#else
    (void)n, (void)k;
    return 0;
#endif
}

/* w [n, k] (rows ldw apart) → wp [n/16][k][16], columns past n zero. */
int vlm_linear_pack(const float *w, int64_t n, int64_t k, int64_t ldw, float *wp) {
#if ROWS_IN_LANES
    if (n <= 0 || k <= 0 || ldw < k) return -1;
    for (int64_t p = 0; p < (n + 15) / 16; p++)
        for (int64_t e = 0; e < k; e++)
            for (int64_t c = 0; c < 16; c++) wp[(p * k + e) * 16 + c] = p * 16 + c < n ? w[(p * 16 + c) * ldw + e] : 0.0f;
    return 0;
#else
    (void)w, (void)n, (void)k, (void)ldw, (void)wp;
    return -2;
#endif
}

/* y [m, n] (rows ldy apart) = x [m, k] (rows ldx apart) · wᵀ + bias (may be NULL), w packed by vlm_linear_pack;
 * on the vision pool (pool 0) or the prefill pool (1), so that the tower and the decoder, on their own threads,
 * never wait for each other's calls. */
int vlm_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const float *wp, int64_t n, const float *bias,
               float *y, int64_t ldy, int64_t threads, int64_t pool_id) {
#if ROWS_IN_LANES
    gemm_job_t g = {.x = x, .wp = wp, .bias = bias, .y = y, .m = m, .n = n, .k = k, .ldx = ldx, .ldy = ldy};
    return run_gemm(&g, gemm_unit, threads, pool_id);
#else
    (void)x, (void)m, (void)k, (void)ldx, (void)wp, (void)n, (void)bias, (void)y, (void)ldy, (void)threads,
        (void)pool_id;
    return -2;
#endif
}

/* y [m, n] = silu(x · wgᵀ + bg) · (x · wuᵀ + bu), both weights packed by vlm_linear_pack, biases may be NULL: the
 * gated MLP's gate and up projections and its activation in one pass (see glu_unit); pools as vlm_linear. */
int vlm_linear_glu(const float *x, int64_t m, int64_t k, int64_t ldx, const float *wg, const float *wu, int64_t n,
                   const float *bg, const float *bu, float *y, int64_t ldy, int64_t threads, int64_t pool_id) {
#if ROWS_IN_LANES
    glu_job_t q = {.g = {.x = x, .wp = wg, .bias = bg, .y = y, .m = m, .n = n, .k = k, .ldx = ldx, .ldy = ldy},
                   .wu = wu,
                   .bu = bu};
    return run_gemm(&q.g, glu_unit, threads, pool_id);
#else
    (void)x, (void)m, (void)k, (void)ldx, (void)wg, (void)wu, (void)n, (void)bg, (void)bu, (void)y, (void)ldy,
        (void)threads, (void)pool_id;
    return -2;
#endif
}
