/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- one unit: 64 query rows of a head */

#if !ROWS_IN_LANES
static void write_rows(const job_t *j, int64_t s, int64_t h, int64_t r0, int64_t rows, const float *O, const float *l) {
    const int64_t d = j->d, stride = j->heads * d;
    for (int64_t i = 0; i < rows; i++) {
        const float inv = 1.0f / l[i];
        const int64_t off = (j->cu[s] + r0 + i) * stride + h * d;
        if (j->bf16_in) {
            uint16_t *o = (uint16_t *)j->out + off;
            for (int64_t e = 0; e < d; e++) o[e] = f32_to_bf16(O[i * d + e] * inv);
        } else {
            float *o = (float *)j->out + off;
            for (int64_t e = 0; e < d; e++) o[e] = O[i * d + e] * inv;
        }
    }
}
#endif

static void attend_unit(job_t *j, int64_t u) {
    int64_t s, h, c;
    locate_attend(j, u, &s, &h, &c);
    const int64_t len = j->cu[s + 1] - j->cu[s], r0 = c * QB;
    const int64_t rows = len - r0 < QB ? len - r0 : QB;
    const int64_t base = h * j->padded + j->pad[s]; /* padded row of the segment's first row */
#if HAVE_BF16DOT
    if (j->dot) {
#if HAVE_AMX
        if (j->amx) {
            if (packs_itself(j, s)) {
                if (h == 0) attend_short_amx(j, s); /* every head of the segment */
            } else
                attend_unit_amx(j, s, h, r0, rows, len, base);
            return;
        }
#endif
        if (packs_itself(j, s)) {
            if (h == 0) attend_short_dot(j, s); /* every head of the segment */
        } else
            attend_unit_dot(j, s, h, r0, rows, len, base);
        return;
    }
#endif
#if ROWS_IN_LANES
    if (short_t(j, s)) {
        if (h == 0) attend_short_t(j, s); /* every head of the segment */
    } else {
        const int64_t d = j->d;
        attend_t(j, (const float *)j->qp + (base + r0) * d, (const float *)j->kp + base * d,
                 (const float *)j->vp + base * d, s, h, r0, rows, len);
    }
#else
    const int64_t d = j->d, groups = (rows + RT - 1) / RT;
    float O[QB * MAX_D] __attribute__((aligned(64)));
    float S[RT * KB] __attribute__((aligned(64))), P[RT * KB] __attribute__((aligned(64)));
    float m[QB], l[QB], corr[RT];
    memset(O, 0, sizeof(float) * (size_t)(groups * RT * d));
    for (int64_t i = 0; i < QB; i++) m[i] = -INFINITY, l[i] = 0.0f;
    for (int64_t k0 = 0; k0 < len; k0 += KS) {
        const int64_t kv = len - k0 < KS ? len - k0 : KS;
        for (int64_t g = 0; g < groups; g++) {
            float *o = O + g * RT * d, *mg = m + g * RT, *lg = l + g * RT;
            const float *q = (const float *)j->qp + (base + r0 + g * RT) * d;
            qk_f32(q, (const float *)j->kp + (base + k0) * d, d, S);
            for (int r = 0; r < RT; r++) corr[r] = softmax_row(j, S + r * KB, kv, mg + r, lg + r, (vf *)(P + r * KB));
            pv_f32_all(P, (const float *)j->vp + (base + k0) * d, d, o, corr);
        }
    }
    write_rows(j, s, h, r0, rows, O, l);
#endif
}
