/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- a decode step's q/k heads: norm and rotary */

typedef struct {
    job_t base; /* only units / next / unit are used */
    uint16_t *x;             /* bfloat16 rows of `stride` elements; heads [0, heads) at h·d, rotated in place */
    const uint16_t *cos, *sin; /* [rows, d] */
    const uint16_t *wq, *wk; /* per-head RMSNorm weights [d] of the first q_heads heads and of the rest, or NULL */
    int64_t rows, stride, heads, q_heads, d;
    float eps;
} rope_job_t;

/* Rows [16u, 16u + 16): each head x (d elements) becomes (x·cos) + (rotate_half(x)·sin), after RMSNorm with the
 * head's weight where one is given, every op rounded to bfloat16 as torch computes it in that dtype: the norm as
 * rms_norm_unit (its sum of squares in the same order), then round(round(x·c) + round(r·s)) with r = (-x2, x1). */
static void rope_unit(job_t *jb, int64_t u) {
    const rope_job_t *j = (const rope_job_t *)jb;
    const int64_t r1 = (u + 1) * ACT_ROWS < j->rows ? (u + 1) * ACT_ROWS : j->rows, d = j->d, half = d / 2;
    float t[MAX_D] __attribute__((aligned(64)));
    for (int64_t r = u * ACT_ROWS; r < r1; r++) {
        const uint16_t *c = j->cos + r * d, *sn = j->sin + r * d;
        for (int64_t h = 0; h < j->heads; h++) {
            uint16_t *x = j->x + r * j->stride + h * d;
            const uint16_t *w = h < j->q_heads ? j->wq : j->wk;
            if (w) {
                const float inv = inv_rms(x, d, 1, j->eps);
                int64_t e = 0;
                for (; e + VW <= d; e += VW)
                    *(vf *)(t + e) = round_bf16(load_elems(w, e, 1) * round_bf16(load_elems(x, e, 1) * inv));
                for (; e < d; e++) {
                    const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[e]) * inv));
                    t[e] = bf16_to_f32(f32_to_bf16(bf16_to_f32(w[e]) * normed));
                }
            } else {
                int64_t e = 0;
                for (; e + VW <= d; e += VW) *(vf *)(t + e) = load_elems(x, e, 1);
                for (; e < d; e++) t[e] = bf16_to_f32(x[e]);
            }
            /* the two halves together, x1 = t[e], x2 = t[e + half]: (x1·c - x2·s, x2·c' + x1·s'), every
             * product and the sum rounded as torch's; VW lanes, then the half's tail one by one */
            int64_t e = 0;
            for (; e + VW <= half; e += VW) {
                const vf x1 = *(const vf *)(t + e), x2 = *(const vf *)(t + e + half);
                const vf lo = round_bf16(x1 * load_elems(c, e, 1)) + round_bf16(-x2 * load_elems(sn, e, 1));
                const vf hi = round_bf16(x2 * load_elems(c, e + half, 1)) + round_bf16(x1 * load_elems(sn, e + half, 1));
                store_elems(x, e, lo, 1);
                store_elems(x, e + half, hi, 1);
            }
            for (; e < half; e++) {
                const float x1 = t[e], x2 = t[e + half];
                const float a = bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(c[e])));
                const float b = bf16_to_f32(f32_to_bf16(-x2 * bf16_to_f32(sn[e])));
                x[e] = f32_to_bf16(a + b);
                const float a2 = bf16_to_f32(f32_to_bf16(x2 * bf16_to_f32(c[e + half])));
                const float b2 = bf16_to_f32(f32_to_bf16(x1 * bf16_to_f32(sn[e + half])));
                x[e + half] = f32_to_bf16(a2 + b2);
            }
        }
    }
}

/* In place on bfloat16 x [rows, stride]: heads [0, heads) of d elements each (the first q_heads normed with wq, the
 * rest with wk, where given) rotated by cos/sin [rows, d]; the step's q and k in one call where torch makes a dozen
 * ops (two norms, and per rotation the two products, the half swap, the negation and the sum). */
int vlm_rope_heads(void *x, const void *cos, const void *sin, const void *wq, const void *wk, int64_t rows,
                   int64_t stride, int64_t heads, int64_t q_heads, int64_t d, float eps, int64_t threads,
                   int64_t pool) {
    if (rows < 0 || heads <= 0 || d <= 0 || d % 2 || d > MAX_D || stride < heads * d) return -3;
    if ((wq == NULL) != (wk == NULL)) return -4;
    rope_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.cos = cos, j.sin = sin, j.wq = wq, j.wk = wk, j.rows = rows, j.stride = stride, j.heads = heads;
    j.q_heads = q_heads, j.d = d, j.eps = eps;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, rope_unit, threads, pool);
}
