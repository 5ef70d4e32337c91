/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- RMSNorm */

typedef struct {
    job_t base; /* only units / next / unit are used */
    const void *x, *weight;
    void *out;
    int64_t rows, cols, bf16;
    float eps;
} norm_job_t;

/* 1 / sqrt(mean(x²) + eps) over one row of `cols` float32 or bfloat16 elements, the squares summed in one order:
 * the norm kernel's and the q/k norms of vlm_rope_heads (whose bits must agree). */
static inline float inv_rms(const void *x, int64_t cols, int64_t bf16, float eps) {
    const int64_t full = cols / VW * VW;
    vf acc = {};
    for (int64_t c = 0; c < full; c += VW) {
        const vf v = load_elems(x, c, bf16);
        acc += v * v;
    }
    float ss = vsum_all(acc);
    for (int64_t c = full; c < cols; c++) {
        const float v = bf16 ? bf16_to_f32(((const uint16_t *)x)[c]) : ((const float *)x)[c];
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)cols + eps);
}

/* Rows [16u, 16u + 16): out = weight · round(x · rsqrt(mean(x²) + eps)), as transformers' Qwen2RMSNorm computes it
 * (in float32; the normalised row rounded to the input dtype before the weight, the product rounded again). */
static void rms_norm_unit(job_t *jb, int64_t u) {
    const norm_job_t *j = (const norm_job_t *)jb;
    const int64_t r1 = (u + 1) * ACT_ROWS < j->rows ? (u + 1) * ACT_ROWS : j->rows, cols = j->cols;
    const int64_t full = cols / VW * VW;
    for (int64_t r = u * ACT_ROWS; r < r1; r++) {
        const int64_t row = r * cols;
        const char *xr = (const char *)j->x + row * (j->bf16 ? 2 : 4);
        const float inv = inv_rms(xr, cols, j->bf16, j->eps);
        for (int64_t c = 0; c < full; c += VW) {
            vf t = load_elems(j->x, row + c, j->bf16) * inv;
            if (j->bf16) t = round_bf16(t);
            store_elems(j->out, row + c, load_elems(j->weight, c, j->bf16) * t, j->bf16);
        }
        for (int64_t c = full; c < cols; c++) {
            if (j->bf16) {
                const float t = bf16_to_f32(f32_to_bf16(bf16_to_f32(((const uint16_t *)j->x)[row + c]) * inv));
                ((uint16_t *)j->out)[row + c] = f32_to_bf16(bf16_to_f32(((const uint16_t *)j->weight)[c]) * t);
            } else {
                ((float *)j->out)[row + c] = ((const float *)j->weight)[c] * (((const float *)j->x)[row + c] * inv);
            }
        }
    }
}

/* out [rows, cols] = RMSNorm(x) · weight (x, weight and out all float32 or all bfloat16) on `pool`; one pass over x where
 * torch makes seven (the float32 copy, square, mean, rsqrt, scale, the rounding copy, the weight). */
int vlm_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t cols, float eps, int64_t dtype,
                 int64_t threads, int64_t pool) {
    if (dtype != 0 && dtype != 1) return -2;
    if (rows < 0 || cols <= 0) return -3;
    norm_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.weight = weight, j.out = out, j.rows = rows, j.cols = cols, j.bf16 = dtype == 1, j.eps = eps;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, rms_norm_unit, threads, pool);
}
