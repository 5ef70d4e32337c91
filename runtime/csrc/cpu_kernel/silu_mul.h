/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- the gated MLP's silu(gate) · up */

typedef struct {
    job_t base; /* only units / next / unit are used */
    const void *gate_rows, *up_rows; /* row r's gate and up elements start at r · ld */
    void *out_rows;                  /* row r's at r · cols */
    int64_t rows, cols, ld, blocks, bf16; /* blocks: units a row */
} silu_job_t;

#define SILU_BLOCK 4096 /* elements a unit */

/* out = round(round(silu(gate)) · up) over one row's elements [4096b, 4096b + 4096) (u = row · blocks + b): as torch
 * computes silu(gate) * up in the input dtype (each op in float32, rounded to the dtype), in one pass instead of
 * two. The loops index from the row's start: an element's arithmetic (vector lanes or the scalar tail) depends on
 * its column only, not on the row stride. */
static void silu_mul_unit(job_t *jb, int64_t u) {
    const silu_job_t *j = (const silu_job_t *)jb;
    const int64_t r = u / j->blocks, b = u % j->blocks, bf16 = j->bf16, size = bf16 ? 2 : 4;
    const void *gate = (const char *)j->gate_rows + r * j->ld * size, *up = (const char *)j->up_rows + r * j->ld * size;
    void *out = (char *)j->out_rows + r * j->cols * size;
    const int64_t i1 = (b + 1) * SILU_BLOCK < j->cols ? (b + 1) * SILU_BLOCK : j->cols;
    int64_t i = b * SILU_BLOCK;
#if HAVE_BF16DOT
    if (bf16) /* 16 lanes, exp2_512 and a refined reciprocal, as quick_gelu_unit */
        for (; i + 16 <= i1; i += 16) {
            const __m512 g = widen_bf16((const uint16_t *)gate + i);
            const __m512 sr = widen_bf16_vec(bf16_16(y_sigmoid_512(g, 1.0f))); /* silu rounded, as torch's */
            const __m512 u16 = widen_bf16((const uint16_t *)up + i);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), bf16_16(_mm512_mul_ps(sr, u16)));
        }
#endif
    for (; i + VW <= i1; i += VW) {
        vf sg = y_sigmoid_v(load_elems(gate, i, bf16), 1.0f);
        if (bf16) sg = round_bf16(sg);
        store_elems(out, i, sg * load_elems(up, i, bf16), bf16);
    }
    for (; i < i1; i++) {
        const float g = bf16 ? bf16_to_f32(((const uint16_t *)gate)[i]) : ((const float *)gate)[i];
        const float v = bf16 ? bf16_to_f32(((const uint16_t *)up)[i]) : ((const float *)up)[i];
        float sg = g / (1.0f + expf(-g));
        if (bf16) {
            sg = bf16_to_f32(f32_to_bf16(sg));
            ((uint16_t *)out)[i] = f32_to_bf16(sg * v);
        } else {
            ((float *)out)[i] = sg * v;
        }
    }
}

/* out [rows, cols] = silu(gate) · up (all float32 or all bfloat16) on `pool`; row r of gate and of up starts at
 * element r · ld of its pointer (ld ≥ cols), out's rows are contiguous. A fused gate-up projection's output
 * [rows, 2 · cols] is gate = x, up = x + cols, ld = 2 · cols: its halves need no copies. */
int vlm_silu_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t cols, int64_t ld, int64_t dtype,
                 int64_t threads, int64_t pool) {
    if (dtype != 0 && dtype != 1) return -2;
    if (rows < 0 || cols < 0 || ld < cols) return -3;
    if (rows == 0 || cols == 0) return 0;
    silu_job_t j;
    memset(&j, 0, sizeof j);
    j.gate_rows = gate, j.up_rows = up, j.out_rows = out, j.rows = rows, j.cols = cols, j.ld = ld;
    j.blocks = (cols + SILU_BLOCK - 1) / SILU_BLOCK, j.bf16 = dtype == 1;
    return run_elementwise(&j.base, rows * j.blocks, silu_mul_unit, threads, pool);
}
