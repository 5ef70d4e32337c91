/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- the gated MLP's silu(gate) · up */

typedef struct {
    job_t base; /* only units / next / unit are used */
    const void *gate, *up;
    void *out;
    int64_t n, bf16;
} silu_job_t;

#define SILU_BLOCK 4096 /* elements a unit */

/* out = round(round(silu(gate)) · up) over elements [4096u, 4096u + 4096): as torch computes silu(gate) * up in
 * the input dtype (each op in float32, rounded to the dtype), in one pass instead of two. */
static void silu_mul_unit(job_t *jb, int64_t u) {
    const silu_job_t *j = (const silu_job_t *)jb;
    const int64_t i1 = (u + 1) * SILU_BLOCK < j->n ? (u + 1) * SILU_BLOCK : j->n;
    int64_t i = u * SILU_BLOCK;
#if HAVE_BF16DOT
    if (j->bf16) /* 16 lanes, exp2_512 and a refined reciprocal, as quick_gelu_unit */
        for (; i + 16 <= i1; i += 16) {
            const __m512 g = widen_bf16((const uint16_t *)j->gate + i);
            const __m512 sr = widen_bf16_vec(bf16_16(y_sigmoid_512(g, 1.0f))); /* silu rounded, as torch's */
            const __m512 up = widen_bf16((const uint16_t *)j->up + i);
            _mm256_storeu_si256((__m256i *)((uint16_t *)j->out + i), bf16_16(_mm512_mul_ps(sr, up)));
        }
#endif
    for (; i + VW <= i1; i += VW) {
        vf sg = y_sigmoid_v(load_elems(j->gate, i, j->bf16), 1.0f);
        if (j->bf16) sg = round_bf16(sg);
        store_elems(j->out, i, sg * load_elems(j->up, i, j->bf16), j->bf16);
    }
    for (; i < i1; i++) {
        const float g = j->bf16 ? bf16_to_f32(((const uint16_t *)j->gate)[i]) : ((const float *)j->gate)[i];
        const float up = j->bf16 ? bf16_to_f32(((const uint16_t *)j->up)[i]) : ((const float *)j->up)[i];
        float sg = g / (1.0f + expf(-g));
        if (j->bf16) {
            sg = bf16_to_f32(f32_to_bf16(sg));
            ((uint16_t *)j->out)[i] = f32_to_bf16(sg * up);
        } else {
            ((float *)j->out)[i] = sg * up;
        }
    }
}

/* out[n] = silu(gate) · up (all float32 or all bfloat16, contiguous). */
int vlm_silu_mul(const void *gate, const void *up, void *out, int64_t n, int64_t dtype, int64_t threads) {
    if (dtype != 0 && dtype != 1) return -2;
    if (n < 0) return -3;
    silu_job_t j;
    memset(&j, 0, sizeof j);
    j.gate = gate, j.up = up, j.out = out, j.n = n, j.bf16 = dtype == 1;
    return run_elementwise(&j.base, (n + SILU_BLOCK - 1) / SILU_BLOCK, silu_mul_unit, threads);
}
