/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- the products */

#if HAVE_BF16DOT
/* The bf16 path keeps query rows in lanes: a tile is 16 query rows, and every score vector holds one key's
 * scores for those 16 rows (every accumulator of the output, one dim's values for them). The online softmax is
 * then vertical: the block's max, the sum and the corrections are plain vector ops, and one exp2 gives all 16
 * rows' corrections, where rows in registers needed two horizontal reductions per row and block. Layouts: q and
 * k in tiles of 16 rows, [D/2 pairs][16][2] (a key's pair of dims is a 32-bit broadcast), v in pairs of keys ×
 * dims [KB/2][D][2] (a 32-bit broadcast per dim). */
#define TR 16 /* query rows per tile: the lanes */

static inline __m512bh bcast_pair(const uint16_t *p) {
    int32_t w;
    memcpy(&w, p, 4);
    return (__m512bh)_mm512_set1_epi32(w);
}

/* S[i] = the tile's 16 rows · key i, i < 16; qt and kt: tiles [D/2][16][2] of 16 rows and 16 keys (one dim
 * pair of the 16 keys is one cache line: the broadcasts' addresses are a pointer and constant offsets). */
static inline void qk_tile(const uint16_t *qt, const uint16_t *kt, int64_t d, __m512 *S) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < d / 2; dp++) {
        const __m512bh q = (__m512bh)_mm512_load_si512(qt + dp * 32);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], q, bcast_pair(kt + dp * 32 + 2 * i));
    }
    for (int i = 0; i < 16; i++) S[i] = a[i];
}

/* Ot[e] (e in [d0, d0 + 16), 16 rows each) = Ot[e] · corr + Σ pairs P[jp] · v[jp][e]; vb: the block's pairs. */
static inline void pv_tile(const __m512i *P, int64_t pairs, const uint16_t *vb, int64_t d, int64_t d0, float *Ot,
                           __m512 corr) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_mul_ps(_mm512_load_ps(Ot + (d0 + i) * TR), corr);
    for (int64_t jp = 0; jp < pairs; jp++) {
        const __m512bh p = (__m512bh)P[jp];
        const uint16_t *v = vb + jp * 2 * d + d0 * 2;
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], p, bcast_pair(v + 2 * i));
    }
    for (int i = 0; i < 16; i++) _mm512_store_ps(Ot + (d0 + i) * TR, a[i]);
}

/* 2^x on AVX-512 for the bf16 path: n = round(x), 2^(x - n) by a degree-5 near-minimax polynomial on
 * [-1/2, 1/2] (relative error 2.4e-7, float32's rounding), scaled by 2^n with vscalefps. Inputs are clamped
 * below at -126 like exp2_v (-inf gives 2^-126; callers zero masked lanes themselves). 9 instructions against
 * exp2_v's 14, which matters: the softmax is the only work in the loop besides the dot products. */
static inline __m512 exp2_512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(1.327647129073739e-3f), _mm512_set1_ps(9.675540961325169e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713092088699e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
    return _mm512_scalef_ps(p, n);
}

/* P_CENTRE · 2^x for the probabilities (x finite, <= 0 but for the lazy blocks of softmax_tile): 2^f for the
 * fraction f = x - floor(x) in [0, 1) (vreduceps) by a degree-3 near-minimax polynomial (relative error 7.5e-5,
 * below the 2^-9 of the bfloat16 P it is rounded to), times 2^floor(x) (vscalefps floors its exponent itself).
 * No clamp: vscalefps takes it to 0 below float32's range. 5 instructions against exp2_512's 9.
 * P is rounded to bfloat16 by truncation (softmax_pair), which takes 0.28 % off a value on average (half a
 * bfloat16 step, over the mantissas of a binade): the polynomial's coefficients are scaled by P_CENTRE to put
 * that back, and softmax_tile divides the row sums by it.
 * NOTE: rounding x to nearest (vroundscaleps) and subtracting, for f in [-1/2, 1/2], was one instruction more:
 * the softmax of a block 92-97 ns against 80-82 (2-vCPU Xeon with AMX, benchmarks/amx_step.py). A degree-2
 * polynomial (relative error 1.7e-3) made the softmax 69 ns against 77-79 but not the whole step (246-260 ns
 * against 251-262), raised the mean error against float32 5-9 % and failed 18 kernel tests: not kept. */
#define P_CENTRE 1.00282f
static inline __m512 exp2_p(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const float c = P_CENTRE;
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(7.80242186492132e-2f * c), _mm512_set1_ps(2.260668770948564e-1f * c));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958340290613414e-1f * c));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251264513912e-1f * c));
    return _mm512_scalef_ps(p, x);
}

/* Keys i and i + 1 (if i + 1 < kv) of the block: their probabilities into P's pair i / 2; returns their sum. */
static inline __m512 softmax_pair(const __m512 *S, int64_t i, int64_t kv, const __mmask16 *valid, __m512 sc,
                                  __m512 mnew, __m512i *P) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 p0 = exp2_p(_mm512_fmsub_ps(S[i], sc, mnew));
    __m512 p1 = i + 1 < kv ? exp2_p(_mm512_fmsub_ps(S[i + 1], sc, mnew)) : zero;
    if (valid) { /* exp2_p(-inf) is NaN: masked scores get 0 here */
        p0 = _mm512_maskz_mov_ps(valid[i], p0);
        p1 = i + 1 < kv ? _mm512_maskz_mov_ps(valid[i + 1], p1) : zero;
    }
    /* word 2r ← p(key 2i)[r], word 2r + 1 ← p(key 2i + 1)[r], each float's top 16 bits (truncated: see exp2_p).
     * NOTE: rounding to nearest (vcvtne2ps2bf16, then vpermw to interleave the keys) made the softmax of a block
     * 145 ns against 108-132 (2-vCPU Emerald Rapids, benchmarks/amx_step.py), with the same error against float32
     * (max, mean and mean signed error on 1,024-, 4,096- and 64-row segments, both product paths). */
    P[i / 2] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(p0), 16), _mm512_castps_si512(p1),
                                         _mm512_set1_epi32((int)0xffff0000u), 0xf8);
    return _mm512_add_ps(p0, p1);
}

/* The online softmax of one tile over one block of `kv` keys (S: raw scores; keys past kv are not read): the
 * running max m (in scale2 units) and sum l of the 16 rows moved on, P the block's probabilities rounded to
 * bfloat16 in key pairs [KB/2][16 rows][2] (as flash attention rounds P); returns the rows' correction.
 * `valid` (or NULL: all): per key, the rows (lanes) that may see it; every row must see some key of the
 * first block it is given (its running max is then finite from there on).
 * `settled`: every row's running max is finite (a block before this one was taken) and `valid` is NULL. The
 * block is then first taken against the running max as it is, without a pass for the block's own max: any m
 * serves (P and l are relative to it, and bfloat16 has float32's exponent range), so long as no probability
 * overflows. Where a row's sum passes 2^LAZY_BOUND the block is taken again the exact way (a new max, the
 * correction, P anew); otherwise the correction is 1 and the accumulators need no rescaling. The softmax of a
 * 64-key block: 92-97 ns against 116 (2-vCPU Xeon with AMX, benchmarks/amx_step.py, before exp2_p's vreduceps).
 * What it costs: where a later key outweighs the first block's max, its P is above 1 and rounded like any
 * other, where the exact pass gives a row's max exactly 1. On sharp rows (q · 3, q · 6; 1,024- and 4,096-row
 * segments) the mean error against float32 rose 3-4 % (14.6e-4 against 14.1e-4; torch's bf16 SDPA 14.1e-4),
 * the max error not. The decoder's causal prefill passes settled = 0 (its test bounds the max error against
 * torch's tightly, and one dominant key in a sharp row went past it). Summing the rounded P (vdpbf16ps with
 * ones) instead of float32's took the mean back to +1 % but made the softmax 10 ns slower.
 * NOTE: the max and the sum run in several register chains, unrolled by hand. Written as arrays indexed i % 4,
 * GCC kept the chains on the stack, a store and a reload per key: the softmax of a 64-key block took 163 ns, of
 * which 111 without any exp2 (a Xeon, AVX-512). */
#define LAZY_BOUND 0x1p24f
/* The block's probabilities against the max m into P (softmax_pair), and their sum per row, in two chains */
static inline __m512 softmax_sum(const __m512 *S, int64_t kv, const __mmask16 *valid, __m512 sc, __m512 m,
                                 __m512i *P) {
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 4 <= kv; i += 4) {
        sum0 = _mm512_add_ps(sum0, softmax_pair(S, i, kv, valid, sc, m, P));
        sum1 = _mm512_add_ps(sum1, softmax_pair(S, i + 2, kv, valid, sc, m, P));
    }
    for (; i < kv; i += 2) sum0 = _mm512_add_ps(sum0, softmax_pair(S, i, kv, valid, sc, m, P));
    return _mm512_add_ps(sum0, sum1);
}

static inline __m512 softmax_tile(__m512 *S, int64_t kv, const __mmask16 *valid, float scale2, __m512 *m, __m512 *l,
                                  __m512i *P, int settled) {
    const __m512 sc = _mm512_set1_ps(scale2);
    if (settled && !valid) {
        const __m512 sum = softmax_sum(S, kv, NULL, sc, *m, P);
        if (!_mm512_cmp_ps_mask(sum, _mm512_set1_ps(LAZY_BOUND), _CMP_NLE_UQ)) { /* NaN and inf included */
            *l = _mm512_fmadd_ps(sum, _mm512_set1_ps(1.0f / P_CENTRE), *l);
            return _mm512_set1_ps(1.0f);
        }
    }
    if (valid)
        for (int64_t i = 0; i < kv; i++) S[i] = _mm512_mask_blend_ps(valid[i], _mm512_set1_ps(-INFINITY), S[i]);
    __m512 mx0 = S[0], mx1 = S[0], mx2 = S[0], mx3 = S[0];
    int64_t i = 1;
    for (; i + 4 <= kv; i += 4) {
        mx0 = _mm512_max_ps(mx0, S[i]);
        mx1 = _mm512_max_ps(mx1, S[i + 1]);
        mx2 = _mm512_max_ps(mx2, S[i + 2]);
        mx3 = _mm512_max_ps(mx3, S[i + 3]);
    }
    for (; i < kv; i++) mx0 = _mm512_max_ps(mx0, S[i]);
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx0, mx1), _mm512_max_ps(mx2, mx3));
    const __m512 mnew = _mm512_max_ps(*m, _mm512_mul_ps(mx, sc));
    /* exactly 1 where the max did not move (exp2_512(0) is 1 + 2^-23), so the AMX path can skip rescaling */
    const __m512 corr = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mnew, *m, _CMP_NEQ_OQ), _mm512_set1_ps(1.0f),
                                             exp2_512(_mm512_sub_ps(*m, mnew)));
    const __m512 sum = softmax_sum(S, kv, valid, sc, mnew, P);
    *l = _mm512_fmadd_ps(*l, corr, _mm512_mul_ps(sum, _mm512_set1_ps(1.0f / P_CENTRE)));
    *m = mnew;
    return corr;
}

/* A unit's `rows` output rows, bf16, to out + row · stride: the tiles' accumulators (Ot: [tile][dim][16 rows])
 * divided by the rows' sums l, 16 dims × 16 rows at a time turned into rows in registers. */
static void write_tiles(const float *Ot, const __m512 *l, int64_t d, int64_t rows, uint16_t *out, int64_t stride) {
    for (int64_t t = 0; t * TR < rows; t++) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l[t]);
        const int64_t n = rows - t * TR < TR ? rows - t * TR : TR;
        for (int64_t e0 = 0; e0 < d; e0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_mul_ps(_mm512_load_ps(Ot + (t * d + e0 + i) * TR), inv);
            transpose16(r);
            for (int64_t i = 0; i < n; i++)
                _mm256_storeu_si256((__m256i *)(out + (t * TR + i) * stride + e0), bf16_16_ftz(r[i]));
        }
    }
}

/* `rows` query rows on the bf16 path against keys [0, len): q's tiles from qs (the first row's), k's tiles and
 * v's key pairs from ks and vs (key 0's); the rows out to out, out + stride, … */
static void attend_dot(const job_t *j, const uint16_t *qs, const uint16_t *ks, const uint16_t *vs, int64_t rows,
                       int64_t len, uint16_t *out) {
    const int64_t d = j->d, tiles = (rows + TR - 1) / TR;
    float Ot[(QB / TR) * MAX_D * TR] __attribute__((aligned(64))); /* [tile][dim][16 rows] */
    __m512 S[KB], m[QB / TR], l[QB / TR];
    __m512i P[KB / 2];
    memset(Ot, 0, sizeof(float) * (size_t)(tiles * d * TR));
    for (int64_t t = 0; t < tiles; t++) m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < len; k0 += KB) {
        const int64_t kv = len - k0 < KB ? len - k0 : KB;
        const uint16_t *kb = ks + k0 * d, *vb = vs + k0 * d;
        for (int64_t t = 0; t < tiles; t++) {
            const uint16_t *qt = qs + t * TR * d;
            for (int64_t k1 = 0; k1 < kv; k1 += 16) qk_tile(qt, kb + k1 * d, d, S + k1);
            const __m512 corr = softmax_tile(S, kv, NULL, j->scale2, m + t, l + t, P, k0 > 0);
            for (int64_t d0 = 0; d0 < d; d0 += 16) pv_tile(P, (kv + 1) / 2, vb, d, d0, Ot + t * d * TR, corr);
        }
    }
    write_tiles(Ot, l, d, rows, out, j->heads * d);
}

/* One unit on the bf16 path: `rows` query rows from padded row `base + r0`, keys [0, len) from `base`. */
static void attend_unit_dot(const job_t *j, int64_t s, int64_t h, int64_t r0, int64_t rows, int64_t len,
                            int64_t base) {
    const int64_t d = j->d;
    attend_dot(j, (const uint16_t *)j->qp + (base + r0) * d, (const uint16_t *)j->kp + base * d,
               (const uint16_t *)j->vp + base * d, rows, len,
               (uint16_t *)j->out + (j->cu[s] + r0) * j->heads * d + h * d);
}

/* attend_short_amx's way on the vdpbf16ps path: a segment of at most 64 rows, every head, packed into the unit's
 * own buffers head by head (layouts as pack_unit_bf16 writes them off AMX). */
static void attend_short_dot(const job_t *j, int64_t s) {
    const int64_t d = j->d, len = j->cu[s + 1] - j->cu[s], stride = j->heads * d;
    uint16_t qb[QB * SHORT_DQ] __attribute__((aligned(64))), kb[QB * SHORT_DQ] __attribute__((aligned(64))),
        vb[QB * SHORT_DQ] __attribute__((aligned(64)));
    prefetch_rows(j, j->cu[s], len, 0);
    for (int64_t h = 0; h < j->heads; h++) {
        pack_short(j, s, h, qb, kb, vb);
        attend_dot(j, qb, kb, vb, len, len, (uint16_t *)j->out + j->cu[s] * stride + h * d);
    }
}
#endif

#if HAVE_AMX
/* The AMX path: the same vertical layout as attend_unit_dot (scores and output accumulators hold 16 query rows
 * in the lanes), its products as tile dot products. Sᵀ [16 keys × 16 rows] = k rows (A) · q's tile (B, the same
 * [D/2][16][2] layout as above); Oᵀ [16 dims × 16 rows] += vᵀ (A, 16 dims × 32 keys) · P (B, [16 key pairs][16
 * rows][2], as softmax_tile writes it). The softmax, the rescaling of O and the output stay on AVX-512: a tile
 * product of 16 × 16 × 32 takes 16 cycles, so they, not the products, are most of the time.
 * Tiles: 0-3 accumulators (four 16-key blocks of Sᵀ, or four 16-dim blocks of Oᵀ); for Sᵀ 4-5 q's two halves
 * and 6-7 k rows at head dim 64, else 4 q and 5-7 k rows; for Oᵀ 4-5 vᵀ rows (keys 0-31, 32-63) and 6-7 P
 * (the same keys). Every tile 16 rows × 64 bytes. */
/* GCC's _tile_loadd is an asm statement that does not tell the compiler it reads memory (its _tile_stored does
 * declare the write), so stores of what a tile load is about to read may legally be moved past it: the packed q,
 * k and v of a window unit, P, the accumulators rescaled in memory. The functions that tile-load what C code
 * wrote begin with this barrier; it orders the compiler only and costs nothing at run time. */
static inline void memory_barrier(void) { __asm__ volatile("" ::: "memory"); }

/* Every unit loads the configuration and releases the tiles at its end. NOTE: configuring once per thread and
 * never releasing was tried and faulted (illegal instruction) in a loop of calls; the cause was not pinned down.
 * The calling thread also runs torch, whose oneDNN kernels load and release configurations of their own. */
static void amx_config(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    /* NOTE: not _tile_loadconfig: GCC 12's declares a memory operand of 8 bytes, so where amx_config is inlined
     * the stores to the rest of the 64-byte configuration can go as dead (a bench built from this file got
     * zero column widths and ldtilecfg faulted). This operand is all of it. */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

/* Accumulator c: Oᵀ of dims [16 dt, 16 dt + 16) of the tile at Ot += vᵀ · P, or = on the tile's first block
 * (`fresh`: Ot is not read, so it needs no zeroing; `two`: keys 32-63 are real). vᵀ's two 32-key halves go to
 * tiles 4 and 5, so the second half's load need not wait for the first half's product to have read the tile. */
#define PV_TILE(c, dt)                                                                                         \
    do {                                                                                                       \
        float *o_ = Ot + (dt) * 16 * TR;                                                                       \
        const uint16_t *v_ = vb + (dt) * 16 * KB;                                                              \
        if (fresh)                                                                                             \
            _tile_zero(c);                                                                                     \
        else                                                                                                   \
            _tile_loadd(c, o_, 64);                                                                            \
        _tile_loadd(4, v_, KB * 2);                                                                            \
        if (two) _tile_loadd(5, v_ + 32, KB * 2);                                                              \
        _tile_dpbf16ps(c, 4, 6);                                                                               \
        if (two) _tile_dpbf16ps(c, 5, 7);                                                                      \
        _tile_stored(c, o_, 64);                                                                               \
    } while (0)

/* Head dim 64 (dq 64): keys [16 g, 16 g + 16) against q's two 32-dim halves (tiles 4 and 5), k's halves
 * through tiles 6 and 7 */
#define SCORES_KEYS(g)                                                                                         \
    do {                                                                                                       \
        _tile_loadd(6, kb + 16 * (g) * 64, 128);                                                               \
        _tile_dpbf16ps(g, 6, 4);                                                                               \
        _tile_loadd(7, kb + 16 * (g) * 64 + 32, 128);                                                          \
        _tile_dpbf16ps(g, 7, 5);                                                                               \
    } while (0)

/* Sᵀ of 16 query rows (q's tile qt) × 64 keys (rows kb) into accumulators 0-3.
 * NOTE: at dq 64 both q halves are loaded once, and k alternates between two tiles; the general loop reloads q
 * for each 32 dims, and that load waits for the four products reading the tile before it. Scores alone
 * 75-78 against 60-64 ns a step, the kernel on 4 × 1,024 rows 3 % faster with the PV_TILE order above
 * (2-vCPU Xeon with AMX, benchmarks/amx_step.py and an in-process A/B, medians of 25). */
static inline void amx_scores(const uint16_t *qt, const uint16_t *kb, int64_t dq) {
    memory_barrier(); /* q and k as the packs wrote them */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (dq == 64) {
        _tile_loadd(4, qt, 64);
        _tile_loadd(5, qt + 32 * 16, 64);
        SCORES_KEYS(0);
        SCORES_KEYS(1);
        SCORES_KEYS(2);
        SCORES_KEYS(3);
        return;
    }
    for (int64_t e = 0; e < dq; e += 32) {
        _tile_loadd(4, qt + e * 16, 64);
        _tile_loadd(5, kb + e, dq * 2);
        _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(6, kb + 16 * dq + e, dq * 2);
        _tile_dpbf16ps(1, 6, 4);
        _tile_loadd(7, kb + 32 * dq + e, dq * 2);
        _tile_dpbf16ps(2, 7, 4);
        _tile_loadd(5, kb + 48 * dq + e, dq * 2);
        _tile_dpbf16ps(3, 5, 4);
    }
}

/* One step of the AMX path: the scores of 16 query rows (q's tile qt) against the 64 keys at kb, the online
 * softmax over the first kv of them (`valid`: causal masks, or NULL; `settled`: as softmax_tile's), and their
 * accumulators Ot [dim][16 rows] moved on with vᵀ's 64-key block vb (`fresh`: the tile's first block; Ot is
 * written, not read). */
static inline void amx_step(const uint16_t *qt, const uint16_t *kb, const uint16_t *vb, int64_t d, int64_t dq,
                            int64_t kv, const __mmask16 *valid, float scale2, __m512 *m, __m512 *l, float *Ot,
                            int fresh, int settled) {
    __m512 S[KB];
    __m512i P[KB / 2];
    const int64_t two = kv > 32;
    amx_scores(qt, kb, dq);
    _tile_stored(0, S, 64);
    _tile_stored(1, S + 16, 64);
    _tile_stored(2, S + 32, 64);
    _tile_stored(3, S + 48, 64);
    const __m512 corr = softmax_tile(S, kv, valid, scale2, m, l, P, settled);
    for (int64_t p = (kv + 1) / 2; p < KB / 2; p++) P[p] = _mm512_setzero_si512(); /* keys past kv */
    /* no rescaling where no row's max moved, nor on the first block (the accumulators start from zero tiles) */
    if (!fresh && _mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
        for (int64_t e = 0; e < d; e++) _mm512_store_ps(Ot + e * TR, _mm512_mul_ps(_mm512_load_ps(Ot + e * TR), corr));
    memory_barrier(); /* P and the rescaled accumulators as the vector code wrote them */
    _tile_loadd(6, P, 64);
    if (two) _tile_loadd(7, P + 16, 64);
    int64_t dt = 0;
    for (; dt + 4 <= d / 16; dt += 4) {
        PV_TILE(0, dt);
        PV_TILE(1, dt + 1);
        PV_TILE(2, dt + 2);
        PV_TILE(3, dt + 3);
    }
    for (; dt < d / 16; dt++) PV_TILE(0, dt);
}

/* NOTE: the tile products and the vector units do not overlap on the Xeon this was written on: 16 tile products
 * with their loads took 77 ns, softmax_tile 162 ns (before its chains moved to registers; 125-135 since), the two
 * interleaved 246 ns (no dependency between them), and issuing the next step's scores before this step's softmax
 * bought nothing. So the steps run one after the other. (2026-12-05, benchmarks/amx_step.py: a step 244-261 ns,
 * the 16 products ~35 % of it, the softmax, with no max pass after a row's first block, ~30 %, tile loads and
 * stores the rest; products then softmax 164-168 ns against 169-174 apart: still no overlap.)
 * Tried and not kept (2026-12-05, the same kind of Xeon, in-process A/B of two builds, medians of 25, 2 threads):
 * - software-pipelined steps (step i + 1's scores issued before step i's P·V, its softmax after, so that neither
 *   round trip through memory, scores tile-stored then read, P stored then tile-loaded, waits on its own
 *   store): 2 % slower on 4 × 1,024 and 4,096 rows (64-row windows 4 % faster), the same outputs to the bit;
 *   with S and P double-buffered 3-6 % slower. So the step does not wait on those round trips.
 * - a block's four tiles phase by phase (four scores, four softmaxes, four P·V: one switch between the tile
 *   unit and the vector units where there were four): 9-13 % slower; its S and P take 18 KB more of L1, where
 *   a unit's q tiles, accumulators and one k/v block already take ~46 of 48 KB.
 * - each q tile over every key block before the next (t outer): 7 % slower on 4,096 rows (k and v then come
 *   from L2 at every step); the tiles in pairs over the key blocks: 0-3 % faster, within the noise.
 * - tile loads and stores are what the step's tile half waits on: 24 tile loads (24 KB) and 8 stores (8 KB) a
 *   step against 16 products (benchmarks/amx_step.py, parts 7-10, 2026-12-05: 16 products 76-80 ns on one chained
 *   accumulator or four, the same 16 each after a tile load of its operand 76 ns, 8 tile stores 35 ns, 16 tile
 *   loads of k and v 51 ns from 256 KB of them and 92 ns from 1 MB). Keeping the accumulators in tiles across
 *   key blocks (tiles 0-3, q's halves resident in 4-5, the scores 16 keys at a time in 6, k, v and P through 7)
 *   would take the tile half of a step from ~140 to ~95 ns by these figures, but one q tile over every key
 *   block reads k and v from the whole segment at every step (1 MB for 4,096 rows at head dim 64), which eats
 *   the gain: estimated, not built. */
static void attend_unit_amx(const job_t *j, int64_t s, int64_t h, int64_t r0, int64_t rows, int64_t len,
                            int64_t base) {
    const int64_t d = j->d, dq = j->dq, tiles = (rows + TR - 1) / TR;
    float Ots[(QB / TR) * MAX_D * TR] __attribute__((aligned(64))); /* [tile][dim][16 rows], from the first block */
    __m512 m[QB / TR], l[QB / TR];
    for (int64_t t = 0; t < tiles; t++) m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
    amx_config();
    const uint16_t *qp = j->qp, *kp = j->kp, *vp = j->vp;
    for (int64_t k0 = 0; k0 < len; k0 += KB) { /* segments are padded to 64 rows: all four key tiles exist */
        const int64_t kv = len - k0 < KB ? len - k0 : KB;
        for (int64_t t = 0; t < tiles; t++)
            amx_step(qp + (base + r0 + t * TR) * dq, kp + (base + k0) * dq, vp + (base + k0) * d, d, dq, kv, NULL,
                     j->scale2, m + t, l + t, Ots + t * d * TR, k0 == 0, k0 > 0);
    }
    _tile_release();
    const int64_t stride = j->heads * d;
    write_tiles(Ots, l, d, rows, (uint16_t *)j->out + (j->cu[s] + r0) * stride + h * d, stride);
}
/* A segment of at most 64 rows (Qwen2.5-VL's windows), every head, in the unit of its head 0 (the other heads'
 * units are empty): its rows are prefetched whole, then head by head packed into the unit's own buffers and
 * attended, rather than packed by pack_unit_bf16 into the job's scratch and read back from there. NOTE: 64-row
 * windows 40 % faster, one thread (qkv from DRAM) or two (qkv fresh from a matmul), longer segments unchanged
 * (2-vCPU Xeon with AMX, in-process A/B, medians of 25): the scratch of a 4,096-row pass is 9.4 MB, and each
 * unit's q tiles came back from L3. One head per unit, packing its own lines of the rows, was 18 % slower on
 * two threads than the scratch round trip.
 * Where a window's time goes (2026-12-05, perf, one thread, 530 windows of 16-64 rows, 6 heads of 64, the window
 * layers of benchmarks/encoder_throughput.py's Qwen2.5-VL images): attend_unit 52 % (half of that on the
 * prefetch loop below, waiting for the rows to come from memory), pack_group 32 %, write_tiles 15 %. The
 * windows are 3 % of the tower's attention FLOPs and 14 % of its attention time. Tried and not kept, same
 * windows, two threads, L2 flushed before each call: the next segment's rows (64, 128 or 192 of them)
 * prefetched a slice per head while this one is attended, 10-18 % slower; the rotary rows prefetched with this
 * window's rows, 47-52 % slower (two runs; not understood); no prefetch, 41-52 % slower. */
static void attend_short_amx(const job_t *j, int64_t s) {
    const int64_t d = j->d, dq = j->dq, len = j->cu[s + 1] - j->cu[s], tiles = (len + TR - 1) / TR;
    uint16_t qb[QB * SHORT_DQ] __attribute__((aligned(64))), kb[QB * SHORT_DQ] __attribute__((aligned(64)));
    uint16_t vb[SHORT_DQ * KB] __attribute__((aligned(64))); /* one 64-key block [D][64] (d <= dq) */
    float Ots[(QB / TR) * SHORT_DQ * TR] __attribute__((aligned(64)));
    __m512 m[QB / TR], l[QB / TR];
    prefetch_rows(j, j->cu[s], len, 0);
    const int64_t stride = j->heads * d;
    amx_config(); /* the packs between use no tiles */
    for (int64_t h = 0; h < j->heads; h++) {
        pack_short(j, s, h, qb, kb, vb);
        for (int64_t t = 0; t < tiles; t++) {
            m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
            amx_step(qb + t * TR * dq, kb, vb, d, dq, len, NULL, j->scale2, m + t, l + t, Ots + t * d * TR, 1, 0);
        }
        write_tiles(Ots, l, d, len, (uint16_t *)j->out + j->cu[s] * stride + h * d, stride);
    }
    _tile_release();
}
#endif

int vlm_amx_ready(void) { return amx_granted(); }

#if !ROWS_IN_LANES /* the float32 path of AVX-512 builds and builds without AVX2 */
/* Rows per register pass of the float32 products: the accumulators (RP rows × 4 vectors), four vectors of k or
 * v and a broadcast must fit the register file (32 vectors with AVX-512, 16 with AVX2). */
#if VW == 16
#define RP RT
#else
#define RP 2
#endif
/* Keys per block of the float32 flash loop: one register tile's width (4 vectors). (AVX2 builds now take
 * attend_t; 8 lanes here means a build without AVX2.) With 8 lanes that is 32, not KB: when AVX2 ran this
 * path, on a 2-vCPU Zen 3, 2 threads, 8-30 % faster (benchmarks/README.md), equal on one thread. The reason is
 * not settled: a block's k and v tiles are 16 KB at D 64 instead of 32 KB, the whole of that CPU's L1, which
 * the unit's 16 row groups reread them from. */
#define KS (4 * VW)

/* S[RT][KS keys] = q · kᵀ in float32 (KS = its 4 vectors of keys); kt: 4 tiles of [D][VW keys]. */
static inline void qk_f32(const float *q, const float *kt, int64_t d, float *S) {
    const int64_t ts = (int64_t)VW * d;
    for (int r0 = 0; r0 < RT; r0 += RP) {
        vf a[RP][4] = {};
        for (int64_t e = 0; e < d; e++) {
            vf k0 = *(const vf *)(kt + e * VW), k1 = *(const vf *)(kt + ts + e * VW);
            vf k2 = *(const vf *)(kt + 2 * ts + e * VW), k3 = *(const vf *)(kt + 3 * ts + e * VW);
            /* NOTE: opaque, so kept in registers for every row: left to itself GCC 12 folded a load of k into
             * each row's FMA (one load per FMA), which bound the loop by loads (see pv_dot). */
            __asm__("" : "+v"(k0), "+v"(k1), "+v"(k2), "+v"(k3));
#pragma GCC unroll 4
            for (int r = 0; r < RP; r++) {
                const vf b = vsplat(q[(r0 + r) * d + e]);
                a[r][0] += b * k0;
                a[r][1] += b * k1;
                a[r][2] += b * k2;
                a[r][3] += b * k3;
            }
        }
        for (int r = 0; r < RP; r++)
            for (int t = 0; t < 4; t++) *(vf *)(S + (r0 + r) * KB + t * VW) = a[r][t];
    }
}

static inline __attribute__((always_inline)) void pv_f32(const float *P, const float *vb, int64_t d, int64_t d0,
                                                         const int NV, float *O, const float *corr) {
    for (int r0 = 0; r0 < RT; r0 += RP) {
        vf a[RP][4];
        for (int r = 0; r < RP; r++)
            for (int c = 0; c < NV; c++) a[r][c] = *(const vf *)(O + (r0 + r) * d + d0 + c * VW) * corr[r0 + r];
        const float *vrow = vb + d0;
        for (int64_t jj = 0; jj < KS; jj++, vrow += d) {
            vf v0 = *(const vf *)vrow;
            vf v1 = NV > 1 ? *(const vf *)(vrow + VW) : v0;
            vf v2 = NV > 2 ? *(const vf *)(vrow + 2 * VW) : v0;
            vf v3 = NV > 3 ? *(const vf *)(vrow + 3 * VW) : v0;
            __asm__("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3)); /* kept in registers, as in qk_f32 */
#pragma GCC unroll 4
            for (int r = 0; r < RP; r++) {
                const vf b = vsplat(P[(r0 + r) * KB + jj]);
                a[r][0] += b * v0;
                if (NV > 1) a[r][1] += b * v1;
                if (NV > 2) a[r][2] += b * v2;
                if (NV > 3) a[r][3] += b * v3;
            }
        }
        for (int r = 0; r < RP; r++)
            for (int c = 0; c < NV; c++) *(vf *)(O + (r0 + r) * d + d0 + c * VW) = a[r][c];
    }
}

static void pv_f32_all(const float *P, const float *vb, int64_t d, float *O, const float *corr) {
    int64_t d0 = 0;
    for (; d0 + 4 * VW <= d; d0 += 4 * VW) pv_f32(P, vb, d, d0, 4, O, corr);
    switch ((d - d0) / VW) {
    case 3: pv_f32(P, vb, d, d0, 3, O, corr); break;
    case 2: pv_f32(P, vb, d, d0, 2, O, corr); break;
    case 1: pv_f32(P, vb, d, d0, 1, O, corr); break;
    default: break;
    }
}

/* ---------------------------------------------------------------- the online softmax */

/* One row of S (KS scores, `kv` of them real) → p = 2^(S·scale2 - m) with the running max m and sum l moved
 * on; returns the factor the row's accumulator is scaled by. */
static inline float softmax_row(const job_t *j, const float *S, int64_t kv, float *m, float *l, vf *p) {
    const vi iota = IOTA;
    vf s[KS / VW];
    vf mx = vsplat(-INFINITY);
    for (int i = 0; i < KS / VW; i++) {
        s[i] = *(const vf *)(S + i * VW) * j->scale2;
        if (kv < KS) s[i] = vselect(iota + i * VW < (vi){} + (int32_t)kv, s[i], vsplat(-INFINITY));
        mx = vselect(s[i] > mx, s[i], mx);
    }
    const float bmax = vmax_all(mx);
    const float mnew = *m > bmax ? *m : bmax;
    const float corr = exp2f(*m - mnew);
    vf sum = {};
    for (int i = 0; i < KS / VW; i++) {
        p[i] = exp2_v(s[i] - mnew);
        if (kv < KS) p[i] = vselect(iota + i * VW < (vi){} + (int32_t)kv, p[i], (vf){});
        sum += p[i];
    }
    *l = *l * corr + vsum_all(sum);
    *m = mnew;
    return corr;
}
#endif

#if ROWS_IN_LANES
/* ---------------------------------------------------------------- float32 with query rows in the lanes (AVX2)
 *
 * Each 16 query rows of a unit are two vectors: the scores are Sᵀ [keys][16 rows], so the online softmax's max
 * and sum per row are lane-wise over keys (no horizontal reductions per row and block), the correction a vector
 * exp2, and both products are the 6 × 16 register tile of AVX2 matrix kernels: 12 accumulators, two vector
 * loads and six broadcasts per 12 FMAs (16 registers: 12 + 2 + 1). q·kᵀ runs 6 keys × 16 rows over the head
 * dims with q in tiles [D][16] and k as rows; P·v runs 6 dims × 16 rows over the keys with Pᵀ [keys][16] and v
 * as rows, into Oᵀ [D][16]. */
#define KT 64 /* keys per block (32: equal within this VM's noise, 2026-12-03) */

/* 2^x for x <= 0 on 8 lanes: as exp2_v; the exponent is added to p's bits (x >= -126 keeps it from wrapping
 * below zero; the clamp's p · 2^-126 may come out denormal-rounded, far below anything a sum notices). */
static inline __m256 exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_fmadd_ps(f, _mm256_set1_ps(1.5403530393381606e-4f), _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

/* Sᵀ rows j0 .. j0 + NK of the block: S[j][16] = k[j] · q for the 16 rows of the tile qt [D][16]; x: the
 * rows' running max over the block's real keys (j < kv). */
static inline __attribute__((always_inline)) void qk_t(const float *qt, const float *kb, int64_t d, int64_t j0,
                                                       const int NK, float *S, int64_t kv, __m256 x[2]) {
    __m256 a[6][2];
    for (int t = 0; t < NK; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
    const float *kr = kb + j0 * d;
    for (int64_t e = 0; e < d; e++) {
        __m256 q0 = _mm256_load_ps(qt + e * RG), q1 = _mm256_load_ps(qt + e * RG + 8);
        __asm__("" : "+x"(q0), "+x"(q1)); /* in registers for all NK keys, not folded into each FMA */
#pragma GCC unroll 6
        for (int t = 0; t < NK; t++) {
            const __m256 b = _mm256_broadcast_ss(kr + t * d + e);
            a[t][0] = _mm256_fmadd_ps(b, q0, a[t][0]);
            a[t][1] = _mm256_fmadd_ps(b, q1, a[t][1]);
        }
    }
    for (int t = 0; t < NK; t++) {
        _mm256_store_ps(S + (j0 + t) * RG, a[t][0]);
        _mm256_store_ps(S + (j0 + t) * RG + 8, a[t][1]);
        if (j0 + t < kv) {
            x[0] = _mm256_max_ps(x[0], a[t][0]);
            x[1] = _mm256_max_ps(x[1], a[t][1]);
        }
    }
}

/* Oᵀ dims d0 .. d0 + ND, for 16 rows: Oᵀ[e] = Oᵀ[e] · corr + Σ_j v[j][e] · Pᵀ[j] over the block's kv keys. */
static inline __attribute__((always_inline)) void pv_t(const float *P, const float *vb, int64_t d, int64_t kv,
                                                       int64_t d0, const int ND, float *OT, __m256 c0, __m256 c1) {
    __m256 a[6][2];
    for (int t = 0; t < ND; t++) {
        a[t][0] = _mm256_mul_ps(_mm256_load_ps(OT + (d0 + t) * RG), c0);
        a[t][1] = _mm256_mul_ps(_mm256_load_ps(OT + (d0 + t) * RG + 8), c1);
    }
    const float *vr = vb + d0;
    for (int64_t jj = 0; jj < kv; jj++, vr += d) {
        __m256 p0 = _mm256_load_ps(P + jj * RG), p1 = _mm256_load_ps(P + jj * RG + 8);
        __asm__("" : "+x"(p0), "+x"(p1));
#pragma GCC unroll 6
        for (int t = 0; t < ND; t++) {
            const __m256 b = _mm256_broadcast_ss(vr + t);
            a[t][0] = _mm256_fmadd_ps(b, p0, a[t][0]);
            a[t][1] = _mm256_fmadd_ps(b, p1, a[t][1]);
        }
    }
    for (int t = 0; t < ND; t++) {
        _mm256_store_ps(OT + (d0 + t) * RG, a[t][0]);
        _mm256_store_ps(OT + (d0 + t) * RG + 8, a[t][1]);
    }
}

/* Sᵀ (kv keys × 16 rows, their max x) → Pᵀ in place, m and l (two vectors each, m in scaled units) moved on;
 * returns the accumulators' correction in c. */
static inline void softmax_t(float *S, int64_t kv, const __m256 x[2], float scale2, __m256 m[2], __m256 l[2],
                             __m256 c[2]) {
    const __m256 sc = _mm256_set1_ps(scale2);
    const __m256 n0 = _mm256_max_ps(m[0], _mm256_mul_ps(x[0], sc)), n1 = _mm256_max_ps(m[1], _mm256_mul_ps(x[1], sc));
    c[0] = exp2_8(_mm256_sub_ps(m[0], n0));
    c[1] = exp2_8(_mm256_sub_ps(m[1], n1));
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
#pragma GCC unroll 2
    for (int64_t jj = 0; jj < kv; jj++) {
        const __m256 p0 = exp2_8(_mm256_fmsub_ps(_mm256_load_ps(S + jj * RG), sc, n0));
        const __m256 p1 = exp2_8(_mm256_fmsub_ps(_mm256_load_ps(S + jj * RG + 8), sc, n1));
        _mm256_store_ps(S + jj * RG, p0);
        _mm256_store_ps(S + jj * RG + 8, p1);
        s0 = _mm256_add_ps(s0, p0);
        s1 = _mm256_add_ps(s1, p1);
    }
    l[0] = _mm256_fmadd_ps(l[0], c[0], s0);
    l[1] = _mm256_fmadd_ps(l[1], c[1], s1);
    m[0] = n0;
    m[1] = n1;
}

/* `rows` query rows (q's tiles from qs, the first row's) of head h of segment s, from its row r0, against keys
 * [0, len) (rows of ks and vs, zero past len up to the next multiple of KT). */
static void attend_t(const job_t *j, const float *qs, const float *ks, const float *vs, int64_t s, int64_t h,
                     int64_t r0, int64_t rows, int64_t len) {
    const int64_t d = j->d, groups = (rows + RG - 1) / RG;
    float OT[QB / RG][MAX_D * RG] __attribute__((aligned(32)));
    float S[KT * RG] __attribute__((aligned(32)));
    __m256 m[QB / RG][2], l[QB / RG][2], c[2];
    for (int64_t g = 0; g < groups; g++) {
        memset(OT[g], 0, sizeof(float) * (size_t)(d * RG));
        m[g][0] = m[g][1] = _mm256_set1_ps(-INFINITY);
        l[g][0] = l[g][1] = _mm256_setzero_ps();
    }
    for (int64_t k0 = 0; k0 < len; k0 += KT) {
        const int64_t kv = len - k0 < KT ? len - k0 : KT;
        const float *kb = ks + k0 * d, *vb = vs + k0 * d;
        for (int64_t g = 0; g < groups; g++) {
            const float *qt = qs + g * RG * d;
            /* Tiles of 5 or 6 keys (dims) until the rest is a multiple of 6: 64 = 5 + 5 + 9 × 6, every tile
             * with at least the 8 accumulators that cover the FMAs' latency. Keys past kv are the segment's
             * zero padding (KT divides QB): computed, never read. */
            __m256 x[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
            for (int64_t j0 = 0; j0 < kv;) {
                if ((KT - j0) % 6 == 0) qk_t(qt, kb, d, j0, 6, S, kv, x), j0 += 6;
                else qk_t(qt, kb, d, j0, 5, S, kv, x), j0 += 5;
            }
            softmax_t(S, kv, x, j->scale2, m[g], l[g], c);
            for (int64_t d0 = 0; d0 < d;) {
                if ((d - d0) % 6 == 0) pv_t(S, vb, d, kv, d0, 6, OT[g], c[0], c[1]), d0 += 6;
                else pv_t(S, vb, d, kv, d0, 5, OT[g], c[0], c[1]), d0 += 5;
            }
        }
    }
    const int64_t stride = j->heads * d;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t g = i / RG, slot = i % RG;
        float lv[8];
        _mm256_storeu_ps(lv, l[g][slot / 8]);
        const float inv = 1.0f / lv[slot % 8];
        const float *ot = OT[g] + slot;
        const int64_t off = (j->cu[s] + r0 + i) * stride + h * d;
        if (j->bf16_in) {
            uint16_t *o = (uint16_t *)j->out + off;
            for (int64_t e = 0; e < d; e++) o[e] = f32_to_bf16(ot[e * RG] * inv);
        } else {
            float *o = (float *)j->out + off;
            for (int64_t e = 0; e < d; e++) o[e] = ot[e * RG] * inv;
        }
    }
}

/* A segment of at most 64 rows (Qwen2.5-VL's windows), every head, packed head by head into the unit's own
 * buffers (q's tiles [D][16], k and v as rows, zero rows to 64) and attended there while they are in L1.
 * NOTE: packed by pack_unit into the call's buffers, a pass of 64-row windows ran at a third of the long
 * segments' rate (83 against 240 GFLOP/s, 4,096 rows × 6 heads × 64): the pack wrote the whole pass (19 MB)
 * before the attend phase read it back. */
static void attend_short_t(const job_t *j, int64_t s) {
    const int64_t d = j->d, start = j->cu[s], len = j->cu[s + 1] - start;
    float qb[QB * SHORT_DQ] __attribute__((aligned(32))), kb[QB * SHORT_DQ] __attribute__((aligned(32))),
        vb[QB * SHORT_DQ] __attribute__((aligned(32))), q[SHORT_DQ] __attribute__((aligned(32)));
    const int64_t rows = (len + RG - 1) / RG * RG, keys = (len + KT - 1) / KT * KT;
    for (int64_t i = len; i < rows; i++) /* the last tile's lanes past len */
        for (int64_t e = 0; e < d; e++) qb[(i / RG) * RG * d + e * RG + i % RG] = 0.0f;
    memset(kb + len * d, 0, sizeof(float) * (size_t)((keys - len) * d));
    memset(vb + len * d, 0, sizeof(float) * (size_t)((keys - len) * d));
    prefetch_rows(j, start, len, 0);
    for (int64_t h = 0; h < j->heads; h++) {
        for (int64_t i = 0; i < len; i++) {
            load_row(j, start + i, 0, h, q);
            float *qt = qb + (i / RG) * RG * d + i % RG;
            for (int64_t e = 0; e < d; e++) qt[e * RG] = q[e];
            load_row(j, start + i, 1, h, kb + i * d);
            load_row(j, start + i, 2, h, vb + i * d);
        }
        attend_t(j, qb, kb, vb, s, h, 0, len, len);
    }
}
#endif
