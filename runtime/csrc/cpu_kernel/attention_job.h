/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

/* ---------------------------------------------------------------- the job */

typedef struct job job_t;
struct job {
    const void *qkv;
    const float *cos, *sin;
    const int32_t *cu;
    void *out;
    int64_t segs, heads, d, bf16_in, dot, padded;
    int64_t amx, dq; /* AMX tiles for the products (a bf16 `dot` job); q and k rows padded to dq dims */
    float scale2; /* scale · log2 e */
    int64_t *pad;   /* [segs + 1] padded row offset of each segment */
    int64_t *chunk; /* [segs + 1] prefix count of 64-row chunks */
    void *qp, *kp, *vp;
    void (*unit)(job_t *, int64_t);
    int64_t units;
    atomic_long next;
};

/* (segment, head, chunk within the segment) of unit u; units run head-fastest over chunks in order. */
static inline void locate(const job_t *j, int64_t u, int64_t *s, int64_t *h, int64_t *c) {
    const int64_t g = u / j->heads;
    int64_t lo = 0, hi = j->segs; /* the segment whose chunks hold g: chunk[lo] <= g < chunk[lo + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (j->chunk[mid] <= g) lo = mid;
        else hi = mid;
    }
    *s = lo;
    *h = u % j->heads;
    *c = g - j->chunk[lo];
}

/* Attention unit u: (segment, head, chunk); a segment's units run chunk-fastest within each head, so the chunks
 * that read one head's keys and values come one after another. NOTE: head-fastest (as `locate` orders the pack),
 * 16 heads' keys and values of a 1,024-patch segment (4 MB) went through L2 once per chunk: 2 × 1024 patches ×
 * 16 heads × 64 took 19.6 ms against 7.2 for 4 × 1024 × 4 heads, the same work per step (Xeon, one thread). */
static inline void locate_attend(const job_t *j, int64_t u, int64_t *s, int64_t *h, int64_t *c) {
    const int64_t g = u / j->heads;
    int64_t lo = 0, hi = j->segs; /* the segment whose units hold u: chunk[lo] · heads <= u < chunk[lo + 1] · heads */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (j->chunk[mid] <= g) lo = mid;
        else hi = mid;
    }
    const int64_t n = j->chunk[lo + 1] - j->chunk[lo], local = u - j->chunk[lo] * j->heads;
    *s = lo;
    *h = local / n;
    *c = local % n;
}

/* The pack works on 8 lanes whatever the target (every half of a head is a multiple of 8 wide). */
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));

/* 8 values of q, k or v (`which`) of head h in `row`, from element e, in float32. */
static inline v8f load8(const job_t *j, int64_t row, int64_t which, int64_t h, int64_t e) {
    const int64_t off = ((row * 3 + which) * j->heads + h) * j->d + e;
    if (j->bf16_in) {
        const v8h x = *(const v8h *)((const uint16_t *)j->qkv + off);
        return (v8f)(__builtin_convertvector(x, v8u) << 16);
    }
    return *(const v8f *)((const float *)j->qkv + off);
}

/* f32_to_bf16 on 8 lanes: round to nearest even, NaN kept quiet. */
static inline v8h bf16_8(v8f x) {
    const v8u u = (v8u)x;
    const v8u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & r), v8h);
}

/* One row of q, k or v of head h into x (float32); q and k rotated as transformers' apply_rotary_pos_emb_vision
 * (in float32, then rounded to the input dtype). */
static void load_row(const job_t *j, int64_t row, int64_t which, int64_t h, float *x) {
    const int64_t d = j->d, half = d / 2;
    if (!j->cos || which == 2) {
        for (int64_t e = 0; e < d; e += 8) *(v8f *)(x + e) = load8(j, row, which, h, e);
        return;
    }
    const float *c = j->cos + row * half, *sn = j->sin + row * half;
    for (int64_t e = 0; e < half; e += 8) {
        const v8f a = load8(j, row, which, h, e), b = load8(j, row, which, h, e + half);
        const v8f cv = *(const v8f *)(c + e), sv = *(const v8f *)(sn + e);
        v8f lo = a * cv + (-b) * sv, hi = b * cv + a * sv;
        if (j->bf16_in) {
            lo = (v8f)(__builtin_convertvector(bf16_8(lo), v8u) << 16);
            hi = (v8f)(__builtin_convertvector(bf16_8(hi), v8u) << 16);
        }
        *(v8f *)(x + e) = lo;
        *(v8f *)(x + e + half) = hi;
    }
}

#define RG 16 /* query rows per lane group of attend_t: two vectors of 8 */

/* The float32 products' layouts: q and v as rows, k in tiles of VW keys [D][VW] (with ROWS_IN_LANES: q in tiles
 * of RG rows, k and v as rows). (The bf16 paths pack with pack_unit_bf16.) */
static void store_packed(const job_t *j, int64_t h, int64_t prow, const float *q, const float *k, const float *v) {
    const int64_t d = j->d, base = h * j->padded;
    float *qp = j->qp, *kp = j->kp, *vp = j->vp;
#if ROWS_IN_LANES
    /* q in tiles of RG rows [D][RG], k and v as rows */
    const int64_t group = prow / RG, slot = prow % RG;
    for (int64_t e = 0; e < d; e++) qp[(base + group * RG) * d + e * RG + slot] = q[e];
    memcpy(kp + (base + prow) * d, k, (size_t)d * sizeof(float));
    memcpy(vp + (base + prow) * d, v, (size_t)d * sizeof(float));
#else
    const int64_t tile = prow / VW, lane = prow % VW;
    memcpy(qp + (base + prow) * d, q, (size_t)d * sizeof(float));
    for (int64_t e = 0; e < d; e++) kp[(base + tile * VW) * d + e * VW + lane] = k[e];
    memcpy(vp + (base + prow) * d, v, (size_t)d * sizeof(float));
#endif
}

#if HAVE_BF16DOT || ROWS_IN_LANES
/* qkv rows [first, first + count), every head, on their way to L2; with `rotary`, their rotary rows too */
static inline void prefetch_rows(const job_t *j, int64_t first, int64_t count, int rotary) {
    const int64_t half = j->d / 2, row_bytes = 3 * j->heads * j->d * (j->bf16_in ? 2 : 4);
    const char *rows = (const char *)j->qkv + first * row_bytes;
    for (int64_t b = 0; b < count * row_bytes; b += 64) _mm_prefetch(rows + b, _MM_HINT_T1);
    if (rotary && j->cos)
        for (int64_t b = 0; b < count * half * 4; b += 64) {
            _mm_prefetch((const char *)(j->cos + first * half) + b, _MM_HINT_T1);
            _mm_prefetch((const char *)(j->sin + first * half) + b, _MM_HINT_T1);
        }
}
#endif

#if ROWS_IN_LANES
/* Whether segment s is attended by attend_short_t, which packs its q, k and v itself (pack_unit skips it). */
static inline int short_t(const job_t *j, int64_t s) { return j->cu[s + 1] - j->cu[s] <= QB && j->d <= SHORT_DQ; }
#endif

/* Unit u: the 64-row chunk u (of all segments, in order), every head. NOTE: a unit reads whole rows of qkv in
 * order. Packing one head per unit read 384 of every row's bytes, rows thousands of bytes apart, and ran at
 * DRAM latency (12 ms of a 4 × 1024-patch call that took 40, one thread); rows in order stream. */
static void pack_unit(job_t *j, int64_t u) {
    int64_t s, h, c;
    locate(j, u * j->heads, &s, &h, &c);
#if ROWS_IN_LANES
    if (short_t(j, s)) return;
#endif
    const int64_t start = j->cu[s], len = j->cu[s + 1] - start;
    float q[MAX_D] __attribute__((aligned(32))), k[MAX_D] __attribute__((aligned(32))),
        v[MAX_D] __attribute__((aligned(32)));
    for (int64_t i = 0; i < QB; i++) {
        const int64_t r = c * QB + i;
        if (r >= len) {
            memset(q, 0, sizeof q);
            memset(k, 0, sizeof k);
            memset(v, 0, sizeof v);
        }
        for (h = 0; h < j->heads; h++) {
            if (r < len) {
                load_row(j, start + r, 0, h, q);
                load_row(j, start + r, 1, h, k);
                load_row(j, start + r, 2, h, v);
            }
            store_packed(j, h, j->pad[s] + r, q, k, v);
        }
    }
}

#if HAVE_BF16DOT
/* f32_to_bf16 on 16 lanes (round to nearest even, NaN kept quiet; vcvtneps2bf16 would flush denormals). */
static inline __m256i bf16_16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i rne = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rne, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet));
}

/* The same by vcvtneps2bf16: one instruction against bf16_16's nine, but denormals (below 1.2e-38) go to zero.
 * For attention's own values (q and k after the rotary, the outputs), where that magnitude carries nothing; the
 * elementwise kernels, which promise torch's rounding to the bit, keep bf16_16. The kernel on 4 × 1,024 rows 4 %
 * faster, on 64-row windows 9 % (2-vCPU Xeon with AMX, in-process A/B, medians of 25). */
static inline __m256i bf16_16_ftz(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

static inline __m512 widen_bf16(const uint16_t *p) { /* 16 bfloat16 → float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 widen_bf16_vec(__m256i h) { /* 16 bfloat16 in a register → float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* One head's q or k of a bfloat16 row (src: its d values) into dst, rotated in float32 and rounded once; with no
 * rotary tables, copied. */
static inline void rotate_bf16(const uint16_t *src, const float *c, const float *sn, int64_t d, uint16_t *dst) {
    if (!c) {
        memcpy(dst, src, (size_t)d * 2);
        return;
    }
    const int64_t half = d / 2;
    int64_t e = 0;
#if HAVE_BF16DOT
    for (; e + 16 <= half; e += 16) {
        const __m512 a = widen_bf16(src + e), b = widen_bf16(src + e + half);
        const __m512 cv = _mm512_loadu_ps(c + e), sv = _mm512_loadu_ps(sn + e);
        _mm256_storeu_si256((__m256i *)(dst + e), bf16_16_ftz(_mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv))));
        _mm256_storeu_si256((__m256i *)(dst + e + half), bf16_16_ftz(_mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv))));
    }
#endif
    for (; e < half; e += 8) {
        v8h ah, bh;
        memcpy(&ah, src + e, sizeof ah);
        memcpy(&bh, src + e + half, sizeof bh);
        const v8f a = (v8f)(__builtin_convertvector(ah, v8u) << 16), b = (v8f)(__builtin_convertvector(bh, v8u) << 16);
        const v8f cv = *(const v8f *)(c + e), sv = *(const v8f *)(sn + e);
        const v8h lo = bf16_8(a * cv + (-b) * sv), hi = bf16_8(b * cv + a * sv);
        memcpy(dst + e, &lo, sizeof lo);
        memcpy(dst + e + half, &hi, sizeof hi);
    }
}

#if HAVE_BF16DOT
/* r[i] lane k ← r[k] lane i: 32-, 64- and two 128-bit interleaving stages, 64 shuffles. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = (__m512)_mm512_unpacklo_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
        r[i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
            t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
    }
}

/* 16 rows × `words` 32-bit words (pairs of bf16; row i at in[i], NULL for a zero row) → `nout` vectors of 16
 * words, vector k at out + k · ostride (elements): word k of each of the 16 rows, row i in lane i. */
static inline void transpose_words(const uint16_t *const in[16], int64_t words, uint16_t *out, int64_t ostride,
                                   int64_t nout) {
    const __mmask16 mask = words >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << words) - 1);
    __m512 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = in[i] ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mask, in[i])) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t k = 0; k < nout; k++) _mm512_storeu_ps(out + k * ostride, r[k]);
}

/* One 16-row group of head h on the bf16 paths: rows[i] (i < n, NULL past n) the group's qkv rows, row0 the
 * first one's index (its rotary rows). q and k rotated in float32 and rounded once (as load_row), staged as rows
 * and turned into their tiles 16 × 16 words at a time; v read from the rows as it is and turned into its layout
 * in registers. Destinations: qt q's tile [dq/2][16][2]; kt k's rows [16][dq] on AMX, else its tile [d/2][16][2];
 * vt on AMX the group's first key within a 64-key block [D][64], else its rows in key pairs [16][D] (2i, 2i + 1
 * interleaved). Rows past n are zeros in every layout. */
static inline void pack_group(const job_t *j, const uint16_t *const rows[16], int64_t n, int64_t row0, int64_t h,
                              uint16_t *qt, uint16_t *kt, uint16_t *vt) {
    const int64_t d = j->d, heads = j->heads, dq = j->dq, half = d / 2; /* dq == d off AMX */
    uint16_t qs[16 * MAX_D] __attribute__((aligned(64))), ks[16 * MAX_D] __attribute__((aligned(64)));
    uint16_t *kdst = j->amx ? kt : ks; /* AMX: k rows in place; else staged */
    for (int64_t i = 0; i < 16; i++) {
        uint16_t *qr = qs + i * dq, *kr = kdst + i * dq;
        if (i < n) {
            const float *cs = j->cos ? j->cos + (row0 + i) * half : NULL;
            const float *sn = j->cos ? j->sin + (row0 + i) * half : NULL;
            rotate_bf16(rows[i] + h * d, cs, sn, d, qr);
            rotate_bf16(rows[i] + (heads + h) * d, cs, sn, d, kr);
            if (dq > d) {
                memset(qr + d, 0, (size_t)(dq - d) * 2);
                memset(kr + d, 0, (size_t)(dq - d) * 2);
            }
        } else {
            memset(qr, 0, (size_t)dq * 2);
            memset(kr, 0, (size_t)dq * 2);
        }
    }
    /* q (and k off AMX): tiles [dq/2][16][2], 16 pairs of the 16 rows per transpose */
    const uint16_t *qin[16], *kin[16], *vin[16];
    for (int64_t w = 0; w < dq / 2; w += 16) {
        const int64_t words = dq / 2 - w < 16 ? dq / 2 - w : 16;
        for (int i = 0; i < 16; i++) qin[i] = qs + i * dq + 2 * w, kin[i] = ks + i * dq + 2 * w;
        transpose_words(qin, words, qt + w * 32, 32, words);
        if (!j->amx) transpose_words(kin, words, kt + w * 32, 32, words);
    }
    for (int i = 0; i < 16; i++) vin[i] = rows[i] ? rows[i] + (2 * heads + h) * d : NULL;
    if (j->amx) { /* v: per 64-key block [D][64]; a transpose of 16 rows × 16 dim pairs gives each pair's two dims
                   * for the 16 keys, low and high halves of the words */
        for (int64_t w = 0; w < half; w += 16) {
            const int64_t words = half - w < 16 ? half - w : 16;
            __m512 r[16];
            const __mmask16 mask = words >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << words) - 1);
            for (int i = 0; i < 16; i++)
                r[i] = vin[i] ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mask, vin[i] + 2 * w))
                              : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t k = 0; k < words; k++) {
                const __m512i x = _mm512_castps_si512(r[k]);
                _mm256_storeu_si256((__m256i *)(vt + (2 * (w + k)) * KB), _mm512_cvtepi32_epi16(x));
                _mm256_storeu_si256((__m256i *)(vt + (2 * (w + k) + 1) * KB),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
            }
        }
    } else { /* v in key pairs [D][2]: rows 2i and 2i + 1 interleaved */
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int i = 0; i < 16; i += 2) {
            uint16_t *dst = vt + i * d;
            for (int64_t e = 0; e < d; e += 32) {
                const int64_t m = d - e < 32 ? d - e : 32; /* 16 or 32 dims */
                const __mmask32 mask = m == 32 ? (__mmask32)0xffffffffu : (__mmask32)0xffffu;
                const __m512i a = vin[i] ? _mm512_maskz_loadu_epi16(mask, vin[i] + e) : _mm512_setzero_si512();
                const __m512i b = vin[i + 1] ? _mm512_maskz_loadu_epi16(mask, vin[i + 1] + e) : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + 2 * e, _mm512_permutex2var_epi16(a, lo, b));
                if (m == 32) _mm512_storeu_si512(dst + 2 * e + 32, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
    }
}

/* Whether segment s is attended by attend_short_amx or attend_short_dot, which pack its q, k and v themselves
 * (pack_unit_bf16 skips it) */
static inline int packs_itself(const job_t *j, int64_t s) {
    return j->dot && j->cu[s + 1] - j->cu[s] <= QB && j->dq <= SHORT_DQ;
}


/* The group's 16 rows of segment s from its row r0 (n real) */
static inline int64_t group_rows(const job_t *j, int64_t s, int64_t r0, const uint16_t *rows[16]) {
    const int64_t start = j->cu[s], len = j->cu[s + 1] - start;
    const int64_t n = len - r0 < 16 ? (len - r0 < 0 ? 0 : len - r0) : 16;
    for (int64_t i = 0; i < 16; i++)
        rows[i] = i < n ? (const uint16_t *)j->qkv + (start + r0 + i) * 3 * j->heads * j->d : NULL;
    return n;
}

/* Head h of segment s (at most 64 rows) into a unit's own buffers, laid out as pack_unit_bf16 lays out one 64-row
 * chunk: q's tiles at qb, k at kb, v at vb (on AMX one 64-key block [D][64]). Every group, so keys past the
 * segment's end are zeros (P · v must stay finite). */
static inline void pack_short(const job_t *j, int64_t s, int64_t h, uint16_t *qb, uint16_t *kb, uint16_t *vb) {
    for (int64_t g = 0; g < QB / 16; g++) {
        const uint16_t *rows[16];
        const int64_t n = group_rows(j, s, g * 16, rows);
        pack_group(j, rows, n, j->cu[s] + g * 16, h, qb + g * 16 * j->dq, kb + g * 16 * j->dq,
                   vb + g * 16 * (j->amx ? 1 : j->d));
    }
}

/* pack_unit for bfloat16 input on the bf16 paths: every head of the unit's 64-row chunk, group by group.
 * NOTE: written row by row, each value to its place, the layouts cost a store per pair (q, k) or value (v) to
 * lines 64 or 128 bytes apart, past L1 for a chunk of 16 heads: 8.4 of 34 ms of a 2 × 1024-patch, 16-head × 80
 * call on a Xeon (one thread; 3.0 ms now). */
static void pack_unit_bf16(job_t *j, int64_t u) {
    int64_t s, h, c;
    locate(j, u * j->heads, &s, &h, &c);
    if (packs_itself(j, s)) return;
    const int64_t start = j->cu[s], d = j->d, heads = j->heads, dq = j->dq;
    uint16_t *qp = j->qp, *kp = j->kp, *vp = j->vp;
    for (int64_t g = 0; g < QB / 16; g++) {
        const int64_t r0 = c * QB + g * 16, p0 = j->pad[s] + r0; /* the group's first row, and its padded row */
        const uint16_t *rows[16];
        const int64_t n = group_rows(j, s, r0, rows);
        { /* the next group's rows (past this segment's end too: the next unit's), and their rotary rows, on their
           * way to L2 while this group is packed. NOTE: 256 windows of 64 rows (37 MB of qkv, from DRAM), one
           * thread: 15.3 against 16.9 ms; 4 × 1,024 and 4,920 + 1,564 + 256 rows unchanged; 2 or 4 groups
           * ahead no better than 1 (2-vCPU Xeon with AMX, in-process A/B, medians of 25) */
            const int64_t first = start + r0 + 16, left = j->cu[j->segs] - first;
            prefetch_rows(j, first, left < 16 ? (left < 0 ? 0 : left) : 16, 1);
        }
        for (h = 0; h < heads; h++) {
            const int64_t base = h * j->padded;
            uint16_t *kt = kp + (base + p0) * dq; /* dq == d off AMX */
            uint16_t *vt = j->amx ? vp + (base + p0) / KB * KB * d + (base + p0) % KB : vp + (base + p0) * d;
            pack_group(j, rows, n, start + r0, h, qp + (base + p0) * dq, kt, vt);
        }
    }
}
#endif
