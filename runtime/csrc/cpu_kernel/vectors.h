/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- scalars and vectors */

/* bf16_to_f32 and f32_to_bf16: isa.h */

/* NOTE: a shuffle of lane 0 compiles to one vbroadcastss; (vf){} + x cost an add per broadcast (0 + -0 is
 * +0, so the add stays) and a per-lane loop became 16 masked broadcasts. */
static inline vf vsplat(float x) {
    const vf v = {x};
    return __builtin_shufflevector(v, v, LANE0);
}

static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

static inline float vmax_all(vf x) {
#if VW == 16
    x = vselect(x > __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7), x,
                __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
#endif
    vf y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3
#if VW == 16
                                   , 12, 13, 14, 15, 8, 9, 10, 11
#endif
    );
    x = vselect(x > y, x, y);
    y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5
#if VW == 16
                                , 10, 11, 8, 9, 14, 15, 12, 13
#endif
    );
    x = vselect(x > y, x, y);
    return x[0] > x[1] ? x[0] : x[1];
}

static inline float vsum_all(vf x) {
#if VW == 16
    x = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    x = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3
#if VW == 16
                                    , 12, 13, 14, 15, 8, 9, 10, 11
#endif
    );
    x = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5
#if VW == 16
                                    , 10, 11, 8, 9, 14, 15, 12, 13
#endif
    );
    return x[0] + x[1];
}

/* 2^x for x <= 127: 2^n · p(f), n = round(x), f in [-1/2, 1/2], p the degree-6 Taylor polynomial of
 * e^(f ln 2) (relative error ~1e-7). Inputs below -126 are clamped (2^-126, not 0: callers zero masked
 * lanes themselves). */
static inline vf exp2_v(vf x) {
    const vf lo = vsplat(-126.0f);
    x = vselect(x < lo, lo, x);
    const vf n = (x + 12582912.0f) - 12582912.0f; /* round to nearest by the 1.5·2^23 trick */
    const vf f = x - n;
    vf p = f * 1.5403530393381606e-4f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}
