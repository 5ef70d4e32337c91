/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- LayerNorm, and the residual add before it */

typedef struct {
    job_t base; /* only units / next / unit are used */
    const void *x, *y, *weight, *bias; /* y: the residual branch added to x first, or NULL */
    void *sum, *out;                   /* sum: x + y (rounded to the dtype), written where y is given */
    int64_t rows, cols, bf16;
    float eps;
} ln_job_t;

/* Rows [16u, 16u + 16): s = x (+ y, rounded to the dtype as torch's add), then out = (s·a + b)·weight + bias with
 * a = 1 / sqrt(var(s) + eps), b = -mean(s)·a, in float32 and rounded once, as torch's CPU LayerNorm computes it
 * (its mean and variance by Welford's method: here by two passes over the row, so the last bit differs now and
 * then). The row is read from memory once; its second and third passes find it in L1. */
static void layer_norm_unit(job_t *jb, int64_t u) {
    const ln_job_t *j = (const ln_job_t *)jb;
    const int64_t r1 = (u + 1) * ACT_ROWS < j->rows ? (u + 1) * ACT_ROWS : j->rows, cols = j->cols, bf16 = j->bf16;
    const int64_t full = cols / VW * VW;
    for (int64_t r = u * ACT_ROWS; r < r1; r++) {
        const int64_t row = r * cols;
        const void *s = j->x;
        if (j->y) { /* s = round(x + y), kept for the caller */
            for (int64_t c = 0; c < full; c += VW)
                store_elems(j->sum, row + c, load_elems(j->x, row + c, bf16) + load_elems(j->y, row + c, bf16), bf16);
            for (int64_t c = full; c < cols; c++) {
                if (bf16) {
                    const uint16_t *xa = j->x, *ya = j->y;
                    ((uint16_t *)j->sum)[row + c] = f32_to_bf16(bf16_to_f32(xa[row + c]) + bf16_to_f32(ya[row + c]));
                } else {
                    ((float *)j->sum)[row + c] = ((const float *)j->x)[row + c] + ((const float *)j->y)[row + c];
                }
            }
            s = j->sum;
        }
        vf acc = {};
        for (int64_t c = 0; c < full; c += VW) acc += load_elems(s, row + c, bf16);
        float total = vsum_all(acc);
        for (int64_t c = full; c < cols; c++)
            total += bf16 ? bf16_to_f32(((const uint16_t *)s)[row + c]) : ((const float *)s)[row + c];
        const float mean = total / (float)cols;
        const vf vm = vsplat(mean);
        vf sq = {};
        for (int64_t c = 0; c < full; c += VW) {
            const vf dv = load_elems(s, row + c, bf16) - vm;
            sq += dv * dv;
        }
        float ss = vsum_all(sq);
        for (int64_t c = full; c < cols; c++) {
            const float dv = (bf16 ? bf16_to_f32(((const uint16_t *)s)[row + c]) : ((const float *)s)[row + c]) - mean;
            ss += dv * dv;
        }
        const float a = 1.0f / sqrtf(ss / (float)cols + j->eps), b = -mean * a;
        const vf va = vsplat(a), vb = vsplat(b);
        for (int64_t c = 0; c < full; c += VW) {
            const vf n = load_elems(s, row + c, bf16) * va + vb;
            store_elems(j->out, row + c, n * load_elems(j->weight, c, bf16) + load_elems(j->bias, c, bf16), bf16);
        }
        for (int64_t c = full; c < cols; c++) {
            if (bf16) {
                const float n = bf16_to_f32(((const uint16_t *)s)[row + c]) * a + b;
                const float w = bf16_to_f32(((const uint16_t *)j->weight)[c]);
                ((uint16_t *)j->out)[row + c] = f32_to_bf16(n * w + bf16_to_f32(((const uint16_t *)j->bias)[c]));
            } else {
                const float n = ((const float *)s)[row + c] * a + b;
                ((float *)j->out)[row + c] = n * ((const float *)j->weight)[c] + ((const float *)j->bias)[c];
            }
        }
    }
}

/* out [rows, cols] = LayerNorm(x + y) · weight + bias, with sum = x + y written too where y is given (else
 * LayerNorm(x)); all float32 or all bfloat16, contiguous, on `pool`. The tower's residual add and the next norm
 * in one pass where torch makes two (and its bfloat16 LayerNorm runs at a few GB/s on the CPU). */
int vlm_layer_norm(const void *x, const void *y, void *sum, const void *weight, const void *bias, void *out,
                   int64_t rows, int64_t cols, float eps, int64_t dtype, int64_t threads, int64_t pool) {
    if (dtype != 0 && dtype != 1) return -2;
    if (rows < 0 || cols <= 0 || (y == NULL) != (sum == NULL)) return -3;
    ln_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.y = y, j.sum = sum, j.weight = weight, j.bias = bias, j.out = out, j.rows = rows, j.cols = cols;
    j.bf16 = dtype == 1, j.eps = eps;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, layer_norm_unit, threads, pool);
}
