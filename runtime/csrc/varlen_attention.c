/* Varlen self-attention for vision towers on the CPU: every segment (an image, or a window of one) of a
 * packed batch attends within itself; no padding to the longest segment, no score matrix in memory.
 *
 * In: qkv [N, 3, H, D] (float32 or bfloat16, the qkv projection's rows), optional rotary tables cos/sin
 * [N, D/2] float32, cu_seqlens [S + 1] int32. Out: [N, H, D] in the input dtype.
 *
 * Two phases over a thread pool. Pack: per 64-row chunk of a segment (every head: rows of qkv are read in
 * order) apply the rotary to q and k in float32, round to the input dtype (as transformers does) and lay q, k,
 * v out for the products, each segment padded with zero rows to a multiple of 64. Attend: per (segment, head,
 * 64 query rows) a flash loop over 64-key blocks with an online softmax in float32 (exp2 of scores
 * pre-multiplied by scale·log2 e) and no score matrix in memory.
 *
 * Where the compiler targets AVX512-BF16 (-march=native on such a CPU) and the input is bfloat16, both
 * products are bf16 dot products (vdpbf16ps, float32 accumulation) over tiles of 16 query rows held in the
 * lanes (see attend_unit_dot), P rounded to bfloat16 as flash attention does; on a CPU with AMX-BF16, and
 * where the caller asks for it (`amx`), the same products run as tile products on the same layouts (see
 * attend_unit_amx). Else they are float32 FMAs: with AVX2 (no AVX-512) on 6 × 16 register tiles that hold
 * 16 query rows in the lanes (see attend_t; segments of at most 64 rows are packed and attended in one unit,
 * attend_short_t, as the bf16 paths do); elsewhere on GCC vectors (16 lanes with AVX-512) over 4 query
 * rows × 4 vectors of keys in registers, the flash loop stepping by 4 vectors of keys (KS).
 *
 * The same library holds the MLP's bias + quick-GELU as one in-place pass (vlm_bias_quick_gelu), so the tower's
 * compiled path shares one thread pool.
 *
 * Built by runtime/cpu_kernel.py with `cc -O3 -march=native -ffp-contract=fast`; called through
 * ctypes, which releases the GIL. Returns 0, or a negative code for arguments it refuses.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16DOT 1
#else
#define HAVE_BF16DOT 0
#endif

#if HAVE_BF16DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#if defined(__AVX512F__)
#define VW 16
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#define LANE0 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
#else
#define VW 8
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7}
#define LANE0 0, 0, 0, 0, 0, 0, 0, 0
#endif

/* The float32 products with 8 lanes (AVX2 + FMA, no AVX-512) hold query rows in the lanes (see attend_t). */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ROWS_IN_LANES 1
#else
#define ROWS_IN_LANES 0
#endif

#define QB 64 /* query rows per unit of work, and the row padding of every segment */
#define KB 64 /* keys per block */
#define SHORT_DQ 128 /* the widest padded head dim attend_short_amx and attend_short_dot pack on their stacks */

#define RT 4  /* query rows per register tile of the float32 products */
#define MAX_D 256
#define MAX_THREADS 64

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));

/* ---------------------------------------------------------------- scalars and vectors */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static int amx_state; /* 1: the kernel granted this process the tile data state; -1: refused */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

/* GCC's _tile_loadd is an asm statement that does not tell the compiler it reads memory (its _tile_stored does
 * declare the write), so stores of what a tile load is about to read may legally be moved past it: the packed q,
 * k and v of a window unit, P, the accumulators rescaled in memory. The functions that tile-load what C code
 * wrote begin with this barrier; it orders the compiler only and costs nothing at run time. */
static inline void memory_barrier(void) { __asm__ volatile("" ::: "memory"); }

static void amx_request(void) {
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: Linux enables the 8 KB tile state per process on request */
    amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
}

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

int vlm_amx_ready(void) {
#if HAVE_AMX
    pthread_once(&amx_once, amx_request);
    return amx_state == 1;
#else
    return 0;
#endif
}

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

/* ---------------------------------------------------------------- the pool */

static void work(job_t *j) {
    for (;;) {
        const int64_t u = atomic_fetch_add(&j->next, 1);
        if (u >= j->units) break;
        j->unit(j, u);
    }
}

/* A persistent pool: threads are created once and sleep on a condition variable between calls (no
 * spinning, so they take nothing from torch's own threads in between). One call at a time uses a pool; there
 * are two, so that the decoder's prefill (an engine step) never waits for a vision tower's call on another
 * thread, nor the reverse. */
typedef struct {
    pthread_mutex_t call, lock;
    pthread_cond_t start, done;
    int64_t threads, active;
    uint64_t generation;
    job_t *job;
    void *scratch; /* the calls' packed q, k and v, kept between calls up to SCRATCH_KEEP bytes */
    size_t scratch_bytes;
} pool_t;

#define POOL_INIT                                                                                              \
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,    \
     0, 0, 0, NULL, NULL, 0}
enum { VISION_POOL, PREFILL_POOL, POOLS };
static pool_t pools[POOLS] = {POOL_INIT, POOL_INIT};

/* NOTE: freed and allocated anew in every call, buffers of a few MB came back from the kernel as fresh pages to
 * be zeroed: 8 % of a loop of attention calls on a Xeon (clear_page_erms in perf). */
#define SCRATCH_KEEP ((size_t)64 << 20)

/* `bytes` of 64-byte aligned scratch for a call holding pool->call, or NULL. */
static void *scratch_get(pool_t *pool, size_t bytes) {
    if (bytes > pool->scratch_bytes) {
        free(pool->scratch);
        bytes = (bytes + 63) / 64 * 64;
        pool->scratch = aligned_alloc(64, bytes);
        pool->scratch_bytes = pool->scratch ? bytes : 0;
    }
    return pool->scratch;
}

/* After the call: a buffer past SCRATCH_KEEP goes back (one large batch should not pin its memory). */
static void scratch_done(pool_t *pool) {
    if (pool->scratch_bytes > SCRATCH_KEEP) {
        free(pool->scratch);
        pool->scratch = NULL;
        pool->scratch_bytes = 0;
    }
}

typedef struct {
    pool_t *pool;
    uint64_t seen;
} pool_arg_t;

static void *pool_thread(void *arg) {
    pool_t *pool = ((pool_arg_t *)arg)->pool;
    uint64_t seen = ((pool_arg_t *)arg)->seen;
    free(arg);
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (pool->generation == seen) pthread_cond_wait(&pool->start, &pool->lock);
        seen = pool->generation;
        job_t *j = pool->job;
        pthread_mutex_unlock(&pool->lock);
        if (j) work(j);
        pthread_mutex_lock(&pool->lock);
        if (--pool->active == 0) pthread_cond_signal(&pool->done);
    }
    return NULL;
}

/* After fork() only the calling thread exists: the child starts with empty pools. */
static void pool_after_fork(void) {
    for (int i = 0; i < POOLS; i++) {
        pool_t *pool = &pools[i];
        pthread_mutex_init(&pool->call, NULL);
        pthread_mutex_init(&pool->lock, NULL);
        pthread_cond_init(&pool->start, NULL);
        pthread_cond_init(&pool->done, NULL);
        pool->threads = pool->active = 0;
        pool->job = NULL;
    }
}

static void register_after_fork(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static void pool_grow(pool_t *pool, int64_t want) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, register_after_fork);
    while (pool->threads < want) {
        pool_arg_t *arg = malloc(sizeof *arg);
        if (!arg) break;
        pthread_mutex_lock(&pool->lock);
        *arg = (pool_arg_t){pool, pool->generation};
        pthread_mutex_unlock(&pool->lock);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, pool_thread, arg);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            free(arg);
            break;
        }
        pool->threads++;
    }
}

#ifdef _OPENMP
/* libgomp's team does not survive fork (a child waits on threads it does not have): in a child of a process
 * that ran this library's OpenMP regions, the calls go to the library's own pool instead. */
static atomic_int omp_ran, omp_unusable;
static void omp_after_fork(void) {
    if (atomic_load(&omp_ran)) atomic_store(&omp_unusable, 1);
}
static void register_omp_fork(void) { pthread_atfork(NULL, NULL, omp_after_fork); }
static int use_omp(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_omp_fork);
    if (atomic_load(&omp_unusable)) return 0;
    atomic_store(&omp_ran, 1);
    return 1;
}
#endif

/* Runs every unit of j on the caller and up to threads - 1 others: torch's OpenMP threads, or the pool's where
 * the library is built without OpenMP or runs in a forked child; the caller holds pool->call. */
static void dispatch(pool_t *pool, job_t *j, int64_t threads) {
    atomic_store(&j->next, 0);
    if (threads > j->units) threads = j->units;
    if (threads <= 1) {
        work(j);
        return;
    }
#ifdef _OPENMP
    /* On torch's own OpenMP threads (built with -fopenmp, this library binds to the libgomp torch loaded):
     * NOTE: on a pool of our own, the OpenMP workers torch's last parallel op left spinning (libgomp's
     * GOMP_SPINCOUNT, a few ms) took a core from our threads: a 768 → 1024 float32 linear of 1,024 rows right
     * after a torch call took 15.5 ms against 10.5 with GOMP_SPINCOUNT=10000 (2-vCPU Zen 3). */
    if (use_omp()) {
#pragma omp parallel num_threads((int)threads)
        work(j);
        return;
    }
#endif
    pool_grow(pool, threads - 1);
    pthread_mutex_lock(&pool->lock);
    pool->job = j;
    pool->active = pool->threads;
    pool->generation++;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->lock);
    work(j); /* the caller works too; pool threads beyond threads - 1 find no units left */
    pthread_mutex_lock(&pool->lock);
    while (pool->active > 0) pthread_cond_wait(&pool->done, &pool->lock);
    pool->job = NULL;
    pthread_mutex_unlock(&pool->lock);
}

/* ---------------------------------------------------------------- the MLP's bias + activation */

typedef struct {
    job_t base; /* only units / next / unit are used */
    void *x;
    const void *bias;
    int64_t rows, cols, bf16;
} act_job_t;

#define ACT_ROWS 16

typedef uint32_t vu __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
/* Unaligned views of float32 / bfloat16 arrays: read and written in place. NOTE: memcpy of a whole vector compiled
 * (GCC 12, AVX2 tuning) to two 16-byte loads stored to the stack and reloaded as one 32-byte vector, a failed store
 * forward per operand: silu(gate) · up over 30,100 × 776 floats took 82 ms on 2 threads where g · u takes 37. */
typedef float vf_at __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef uint16_t vh_at __attribute__((vector_size(VW * 2), aligned(2), may_alias));

/* VW elements of a float32 or bfloat16 array, in float32; and back, rounded as f32_to_bf16. */
static inline vf load_elems(const void *p, int64_t i, int64_t bf16) {
    if (bf16) return (vf)(__builtin_convertvector(*(const vh_at *)((const uint16_t *)p + i), vu) << 16);
    return *(const vf_at *)((const float *)p + i);
}

static inline vf round_bf16(vf x) { /* f32_to_bf16 and back, on VW lanes (round to nearest even, NaN quiet) */
    const vu w = (vu)x;
    const vu rne = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
    const vu nan = (vu)((w & 0x7fffffffu) > 0x7f800000u);
    return (vf)(((nan & ((w >> 16) | 0x40u)) | (~nan & rne)) << 16);
}

static inline void store_elems(void *p, int64_t i, vf x, int64_t bf16) {
    if (bf16) *(vh_at *)((uint16_t *)p + i) = __builtin_convertvector((vu)round_bf16(x) >> 16, vh);
    else *(vf_at *)((float *)p + i) = x;
}

/* y · sigmoid(a·y) = y / (1 + 2^t), t = -a·y · log2 e, clamped where exp2_v holds (t <= 126): quick_gelu with
 * a = 1.702, silu with a = 1. */
static inline vf y_sigmoid_v(vf y, float a) {
    vf t = y * (a * -1.4426950408889634f);
    t = vselect(t > vsplat(126.0f), vsplat(126.0f), t);
    return y / (1.0f + exp2_v(t));
}

#if HAVE_BF16DOT
/* The same on 16 lanes with exp2_512 and a refined reciprocal (2^-14, then one Newton step: float32's rounding). */
static inline __m512 y_sigmoid_512(__m512 y, float a) {
    const __m512 t = _mm512_min_ps(_mm512_mul_ps(y, _mm512_set1_ps(a * -1.4426950408889634f)), _mm512_set1_ps(126.0f));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp2_512(t));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(y, inv);
}
#endif

/* x = quick_gelu(x + bias), in float32, rounded once (to nearest even, as f32_to_bf16); rows [16u, 16u + 16). */
static void quick_gelu_unit(job_t *jb, int64_t u) {
    const act_job_t *j = (const act_job_t *)jb;
    const int64_t r1 = (u + 1) * ACT_ROWS < j->rows ? (u + 1) * ACT_ROWS : j->rows, cols = j->cols;
    for (int64_t r = u * ACT_ROWS; r < r1; r++) {
        int64_t c0 = 0;
#if HAVE_BF16DOT
        if (j->bf16) /* 16 lanes, exp2_512 and a refined reciprocal: twice the rate of the generic vectors below */
            for (; c0 + 16 <= cols; c0 += 16) {
                uint16_t *x = (uint16_t *)j->x + r * cols + c0;
                __m512 y = widen_bf16(x);
                if (j->bias) y = _mm512_add_ps(y, widen_bf16((const uint16_t *)j->bias + c0));
                _mm256_storeu_si256((__m256i *)x, bf16_16(y_sigmoid_512(y, 1.702f)));
            }
#endif
        for (; c0 + VW <= cols; c0 += VW) {
            const int64_t i = r * cols + c0;
            const vf y = load_elems(j->x, i, j->bf16) + (j->bias ? load_elems(j->bias, c0, j->bf16) : vsplat(0.0f));
            store_elems(j->x, i, y_sigmoid_v(y, 1.702f), j->bf16);
        }
        if (c0 == cols) continue;
        float y[VW] = {0};
        for (int64_t e = 0; c0 + e < cols; e++) { /* the tail: one vector's worth, lanes past the row unused */
            const int64_t i = r * cols + c0 + e;
            y[e] = j->bf16 ? bf16_to_f32(((const uint16_t *)j->x)[i]) : ((const float *)j->x)[i];
            if (j->bias)
                y[e] += j->bf16 ? bf16_to_f32(((const uint16_t *)j->bias)[c0 + e])
                                : ((const float *)j->bias)[c0 + e];
        }
        vf v;
        memcpy(&v, y, sizeof v);
        v = y_sigmoid_v(v, 1.702f);
        for (int64_t e = 0; c0 + e < cols; e++) {
            const int64_t i = r * cols + c0 + e;
            if (j->bf16) ((uint16_t *)j->x)[i] = f32_to_bf16(v[e]);
            else ((float *)j->x)[i] = v[e];
        }
    }
}

/* An elementwise job's `units` on the vision pool (the tower's kernels share it); returns 0. */
static int run_elementwise(job_t *j, int64_t units, void (*unit)(job_t *, int64_t), int64_t threads) {
    j->units = units;
    j->unit = unit;
    if (threads <= 1 || units <= 1) {
        /* on the caller alone, without the vision pool: a decode step's norm or silu · up (a few rows) must not
         * wait for a tower's call on another thread, and needs no other thread */
        atomic_store(&j->next, 0);
        work(j);
        return 0;
    }
    pool_t *pool = &pools[VISION_POOL];
    pthread_mutex_lock(&pool->call);
    dispatch(pool, j, threads > MAX_THREADS ? MAX_THREADS : threads);
    pthread_mutex_unlock(&pool->call);
    return 0;
}

int vlm_bias_quick_gelu(void *x, const void *bias, int64_t rows, int64_t cols, int64_t dtype, int64_t threads) {
    if (dtype != 0 && dtype != 1) return -2;
    if (rows < 0 || cols <= 0) return -3;
    act_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.bias = bias, j.rows = rows, j.cols = cols, j.bf16 = dtype == 1;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, quick_gelu_unit, threads);
}

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

/* out [rows, cols] = RMSNorm(x) · weight (x, weight and out all float32 or all bfloat16); one pass over x where
 * torch makes seven (the float32 copy, square, mean, rsqrt, scale, the rounding copy, the weight). */
int vlm_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t cols, float eps, int64_t dtype,
                 int64_t threads) {
    if (dtype != 0 && dtype != 1) return -2;
    if (rows < 0 || cols <= 0) return -3;
    norm_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.weight = weight, j.out = out, j.rows = rows, j.cols = cols, j.bf16 = dtype == 1, j.eps = eps;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, rms_norm_unit, threads);
}

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
    float t[MAX_D];
    for (int64_t r = u * ACT_ROWS; r < r1; r++) {
        const uint16_t *c = j->cos + r * d, *sn = j->sin + r * d;
        for (int64_t h = 0; h < j->heads; h++) {
            uint16_t *x = j->x + r * j->stride + h * d;
            const uint16_t *w = h < j->q_heads ? j->wq : j->wk;
            if (w) {
                const float inv = inv_rms(x, d, 1, j->eps);
                for (int64_t e = 0; e < d; e++) {
                    const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[e]) * inv));
                    t[e] = bf16_to_f32(f32_to_bf16(bf16_to_f32(w[e]) * normed));
                }
            } else {
                for (int64_t e = 0; e < d; e++) t[e] = bf16_to_f32(x[e]);
            }
            for (int64_t e = 0; e < d; e++) {
                const float rot = e < half ? -t[e + half] : t[e - half];
                const float a = bf16_to_f32(f32_to_bf16(t[e] * bf16_to_f32(c[e])));
                const float b = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(sn[e])));
                x[e] = f32_to_bf16(a + b);
            }
        }
    }
}

/* In place on bfloat16 x [rows, stride]: heads [0, heads) of d elements each (the first q_heads normed with wq, the
 * rest with wk, where given) rotated by cos/sin [rows, d]; the step's q and k in one call where torch makes a dozen
 * ops (two norms, and per rotation the two products, the half swap, the negation and the sum). */
int vlm_rope_heads(void *x, const void *cos, const void *sin, const void *wq, const void *wk, int64_t rows,
                   int64_t stride, int64_t heads, int64_t q_heads, int64_t d, float eps, int64_t threads) {
    if (rows < 0 || heads <= 0 || d <= 0 || d % 2 || d > MAX_D || stride < heads * d) return -3;
    if ((wq == NULL) != (wk == NULL)) return -4;
    rope_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.cos = cos, j.sin = sin, j.wq = wq, j.wk = wk, j.rows = rows, j.stride = stride, j.heads = heads;
    j.q_heads = q_heads, j.d = d, j.eps = eps;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, rope_unit, threads);
}

/* ---------------------------------------------------------------- a decode step's decoder layer in one call */

/* The few-row linear (runtime/csrc/skinny_linear.c's vlm_skinny_linear) and the paged decode attention
 * (runtime/csrc/paged_decode.c's vlm_paged_decode_bf16): other libraries, handed in as pointers. */
typedef int (*linear_fn)(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w, int64_t n,
                         const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t threads, int64_t path);
typedef int (*attend_fn)(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *tables,
                         int64_t table_stride, const int32_t *lens, uint16_t *out, int64_t seqs, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t threads);

typedef struct { /* one layer's weights and shape: built once (lm_engine/models/fused_decode.py) */
    linear_fn linear;
    attend_fn attend;
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t paths[4];          /* the few-row kernel's path for qkv, o, gate_up, down */
    const void *w[4];          /* their packed buffers */
    const void *bias[2];       /* qkv's and o's bias, or NULL */
    const void *in_norm, *post_norm, *q_norm, *k_norm; /* q_norm/k_norm: Qwen3-VL's per-head norms, or NULL */
    float eps, qk_eps, scale;
} vlm_layer_t;

typedef struct { /* one step's rows, their places in the KV pool, and scratch for the layer's intermediates */
    int64_t m, block_size, table_stride, linear_threads, attend_threads;
    const void *cos, *sin;     /* [m, head_dim] bfloat16 */
    const int64_t *slots;      /* [m] the KV slot each row writes; < 0 writes nothing */
    const int32_t *tables, *lens;
    void *h, *qkv, *q, *attn, *o, *gu, *act; /* [16, ...] bfloat16 */
} vlm_step_t;

static void add_rows_bf16(uint16_t *x, const uint16_t *y, int64_t n) { /* x = round(x + y), as torch's bf16 add */
    int64_t i = 0;
    for (; i + VW <= n; i += VW) store_elems(x, i, load_elems(x, i, 1) + load_elems(y, i, 1), 1);
    for (; i < n; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

/* x [m, hidden] (bfloat16, in place) through one decoder layer for m decode rows, as the decoder's modules compute
 * it with their step kernels, call for call: norm, qkv (+ bias), q/k (norm and) rotary, the KV write at the rows'
 * slots, paged decode attention, o (+ bias), residual, norm, gate/up, silu · up, down, residual. The same kernels
 * in the same order give the same bits (tests/lm_engine/test_fused_decode.py); one call where the modules make
 * about 25. Returns 0 or the first failing call's code. */
int vlm_decode_layer(const vlm_layer_t *L, const vlm_step_t *S, void *x, void *k_cache, void *v_cache) {
    const int64_t m = S->m, hd = L->hidden, d = L->head_dim, qs = L->heads * d, kvs = L->kv_heads * d;
    const int64_t nqkv = qs + 2 * kvs, lt = S->linear_threads;
    uint16_t *xs = x, *h = S->h, *qkv = S->qkv, *attn = S->attn, *o = S->o, *gu = S->gu, *act = S->act;
    int rc;
    if (m < 1 || m > 16) return -3;
    if ((rc = vlm_rms_norm(xs, L->in_norm, h, m, hd, L->eps, 1, 1))) return rc;
    if ((rc = L->linear(h, m, hd, hd, L->w[0], nqkv, L->bias[0], qkv, nqkv, lt, L->paths[0]))) return rc;
    if ((rc = vlm_rope_heads(qkv, S->cos, S->sin, L->q_norm, L->k_norm, m, nqkv, L->heads + L->kv_heads, L->heads, d,
                             L->qk_eps, 1)))
        return rc;
    const uint16_t *q = qkv;
    for (int64_t r = 0; r < m; r++) {
        const int64_t slot = S->slots[r];
        if (slot >= 0) {
            memcpy((uint16_t *)k_cache + slot * kvs, qkv + r * nqkv + qs, (size_t)kvs * 2);
            memcpy((uint16_t *)v_cache + slot * kvs, qkv + r * nqkv + qs + kvs, (size_t)kvs * 2);
        }
        if (m > 1) memcpy((uint16_t *)S->q + r * qs, qkv + r * nqkv, (size_t)qs * 2);
    }
    if (m > 1) q = S->q;
    if ((rc = L->attend(q, k_cache, v_cache, S->tables, S->table_stride, S->lens, attn, m, L->heads, L->kv_heads, d,
                        S->block_size, L->scale, S->attend_threads)))
        return rc;
    if ((rc = L->linear(attn, m, qs, qs, L->w[1], hd, L->bias[1], o, hd, lt, L->paths[1]))) return rc;
    add_rows_bf16(xs, o, m * hd);
    if ((rc = vlm_rms_norm(xs, L->post_norm, h, m, hd, L->eps, 1, 1))) return rc;
    if ((rc = L->linear(h, m, hd, hd, L->w[2], 2 * L->inter, NULL, gu, 2 * L->inter, lt, L->paths[2]))) return rc;
    for (int64_t r = 0; r < m; r++)
        if ((rc = vlm_silu_mul(gu + r * 2 * L->inter, gu + r * 2 * L->inter + L->inter, act + r * L->inter, L->inter,
                               1, 1)))
            return rc;
    if ((rc = L->linear(act, m, L->inter, L->inter, L->w[3], hd, NULL, o, hd, lt, L->paths[3]))) return rc;
    add_rows_bf16(xs, o, m * hd);
    return 0;
}

/* ---------------------------------------------------------------- causal attention: a decoder's prefill */

/* A chunk of lq query rows that ends an lk-token context (query row r sits at position lk - lq + r and sees keys
 * 0 … lk - lq + r), grouped-query heads (query head h reads kv head h / (heads / kv_heads)), bfloat16 in and out,
 * products as bf16 dot products over 16 query rows in lanes as in attend_unit_dot. No rotary: the decoder
 * applies its own before the keys are cached. Rows are given with their own strides (elements), heads packed
 * in each row. Built where the compiler targets AVX512-BF16; elsewhere the entry point refuses (-6) and the
 * caller keeps torch's attention. */
#if HAVE_BF16DOT
typedef struct {
    job_t base; /* units / next / unit, and d, heads, scale2 */
    const uint16_t *q, *k, *v;
    uint16_t *out;
    int64_t qs, ks, vs, os; /* row strides */
    int64_t lq, lk, kv_heads, group;
    int64_t pq, pk, qchunks, kchunks; /* rows padded to 64, and 64-row chunks */
    int64_t amx, dq;                  /* AMX tiles for the products; q and k rows padded to dq dims */
    uint16_t *qp, *kp, *vp; /* q [heads][pq rows] in 16-row tiles; k [kv_heads][pk rows] in 16-row tiles and v in
                             * key pairs, or on AMX k as rows and v per 64-key block [D][64] (as attend_unit_amx) */
} causal_job_t;

/* Row `row` of x (d values) into tiles of 16 rows [dq/2][16][2], dims d … dq zero. */
static inline void put_tile(uint16_t *tiles, int64_t row, int64_t d, int64_t dq, const uint16_t *x) {
    uint16_t *dst = tiles + (row / 16 * 16) * dq + (row % 16) * 2;
    for (int64_t e = 0; e < dq; e += 2) {
        if (e < d) memcpy(dst + e * 16, x + e, 4);
        else memset(dst + e * 16, 0, 4);
    }
}

/* Units [0, qchunks): 64 query rows, every head; then 64 key rows, every kv head. Rows past the end are zeros. */
static void causal_pack_unit(job_t *jb, int64_t u) {
    causal_job_t *j = (causal_job_t *)jb;
    const int64_t d = jb->d, dq = j->dq;
    static const uint16_t zeros[MAX_D];
    if (u < j->qchunks) {
        for (int64_t r = u * QB; r < (u + 1) * QB; r++)
            for (int64_t h = 0; h < jb->heads; h++)
                put_tile(j->qp + h * j->pq * dq, r, d, dq, r < j->lq ? j->q + r * j->qs + h * d : zeros);
        return;
    }
    u -= j->qchunks;
    for (int64_t r = u * QB; r < (u + 1) * QB; r++)
        for (int64_t g = 0; g < j->kv_heads; g++) {
            const uint16_t *k = r < j->lk ? j->k + r * j->ks + g * d : zeros;
            const uint16_t *v = r < j->lk ? j->v + r * j->vs + g * d : zeros;
            if (j->amx) {
                uint16_t *kr = j->kp + (g * j->pk + r) * dq, *vt = j->vp + (g * j->pk + r / KB * KB) * d + r % KB;
                memcpy(kr, k, (size_t)d * 2);
                memset(kr + d, 0, (size_t)(dq - d) * 2);
                for (int64_t e = 0; e < d; e++) vt[e * KB] = v[e];
            } else {
                put_tile(j->kp + g * j->pk * d, r, d, d, k);
                uint16_t *dst = j->vp + (g * j->pk + r / 2 * 2) * d + r % 2;
                for (int64_t e = 0; e < d; e++) dst[e * 2] = v[e];
            }
        }
}

/* Unit u: one head's 64 query rows, the chunks with the most keys first (units are taken in order). */
static void causal_unit(job_t *jb, int64_t u) {
    const causal_job_t *j = (const causal_job_t *)jb;
    const int64_t d = jb->d, heads = jb->heads;
    const int64_t c = j->qchunks - 1 - u / heads, h = u % heads, g = h / j->group;
    const int64_t r0 = c * QB, rows = j->lq - r0 < QB ? j->lq - r0 : QB, tiles = (rows + TR - 1) / TR;
    const int64_t pos0 = j->lk - j->lq + r0; /* position of the unit's first row */
    float Ot[(QB / TR) * MAX_D * TR] __attribute__((aligned(64)));
    __m512 S[KB], m[QB / TR], l[QB / TR];
    __m512i P[KB / 2];
    __mmask16 valid[KB];
    memset(Ot, 0, sizeof(float) * (size_t)(tiles * d * TR));
    for (int64_t t = 0; t < tiles; t++) m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
    const uint16_t *kt = j->kp + g * j->pk * d, *vt = j->vp + g * j->pk * d;
    const int64_t kend = pos0 + rows; /* keys the unit's last row sees */
    for (int64_t k0 = 0; k0 < kend; k0 += KB) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = pos0 + t * TR, tile_rows = rows - t * TR < TR ? rows - t * TR : TR;
            const int64_t last = first + tile_rows - 1;
            if (k0 > last) continue; /* every key of the block is after every row of the tile */
            const int64_t kv = last + 1 - k0 < KB ? last + 1 - k0 : KB;
            const uint16_t *qt = j->qp + (h * j->pq + r0 + t * TR) * d;
            for (int64_t k1 = 0; k1 < kv; k1 += 16) qk_tile(qt, kt + (k0 + k1) * d, d, S + k1);
            const int diagonal = k0 + kv - 1 > first;
            if (diagonal)
                for (int64_t i = 0; i < kv; i++) { /* lanes r with first + r >= k0 + i */
                    const int64_t skip = k0 + i - first;
                    valid[i] = skip <= 0 ? (__mmask16)0xffff : (__mmask16)(0xffffu << skip);
                }
            const __m512 corr = softmax_tile(S, kv, diagonal ? valid : NULL, jb->scale2, m + t, l + t, P, 0);
            for (int64_t d0 = 0; d0 < d; d0 += 16)
                pv_tile(P, (kv + 1) / 2, vt + k0 * d, d, d0, Ot + t * d * TR, corr);
        }
    }
    write_tiles(Ot, l, d, rows, j->out + r0 * j->os + h * d, j->os);
}

#if HAVE_AMX
/* causal_unit with the products on AMX tiles, as attend_unit_amx (the scores of all 64 keys of a block are
 * computed; the softmax reads the first kv). */
static void causal_unit_amx(job_t *jb, int64_t u) {
    const causal_job_t *j = (const causal_job_t *)jb;
    const int64_t d = jb->d, dq = j->dq, heads = jb->heads;
    const int64_t c = j->qchunks - 1 - u / heads, h = u % heads, g = h / j->group;
    const int64_t r0 = c * QB, rows = j->lq - r0 < QB ? j->lq - r0 : QB, tiles = (rows + TR - 1) / TR;
    const int64_t pos0 = j->lk - j->lq + r0; /* position of the unit's first row */
    float Ots[(QB / TR) * MAX_D * TR] __attribute__((aligned(64)));
    __m512 m[QB / TR], l[QB / TR];
    __mmask16 valid[KB];
    for (int64_t t = 0; t < tiles; t++) m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
    amx_config(); /* each tile's accumulators are written on its first block (k0 = 0), not zeroed here */
    const uint16_t *kt = j->kp + g * j->pk * dq, *vt = j->vp + g * j->pk * d;
    const int64_t kend = pos0 + rows; /* keys the unit's last row sees */
    for (int64_t k0 = 0; k0 < kend; k0 += KB) { /* k0 + 64 <= pk: all four key tiles of a block exist */
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = pos0 + t * TR, tile_rows = rows - t * TR < TR ? rows - t * TR : TR;
            const int64_t last = first + tile_rows - 1;
            if (k0 > last) continue; /* every key of the block is after every row of the tile */
            const int64_t kv = last + 1 - k0 < KB ? last + 1 - k0 : KB;
            const int diagonal = k0 + kv - 1 > first;
            if (diagonal)
                for (int64_t i = 0; i < kv; i++) { /* lanes r with first + r >= k0 + i */
                    const int64_t skip = k0 + i - first;
                    valid[i] = skip <= 0 ? (__mmask16)0xffff : (__mmask16)(0xffffu << skip);
                }
            amx_step(j->qp + (h * j->pq + r0 + t * TR) * dq, kt + k0 * dq, vt + k0 * d, d, dq, kv,
                     diagonal ? valid : NULL, jb->scale2, m + t, l + t, Ots + t * d * TR, k0 == 0, 0);
        }
    }
    _tile_release();
    write_tiles(Ots, l, d, rows, j->out + r0 * j->os + h * d, j->os);
}
#endif

#endif

int vlm_causal_attention(const void *q, const void *k, const void *v, void *out, int64_t lq, int64_t lk,
                         int64_t heads, int64_t kv_heads, int64_t d, int64_t q_stride, int64_t k_stride,
                         int64_t v_stride, int64_t out_stride, float scale, int64_t threads, int64_t amx) {
    if (d <= 0 || d % 16 || d > MAX_D) return -1;
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || lq < 0 || lk < lq) return -3;
#if !HAVE_BF16DOT
    (void)q, (void)k, (void)v, (void)out, (void)q_stride, (void)k_stride, (void)v_stride, (void)out_stride;
    (void)scale, (void)threads, (void)amx;
    return -6;
#else
    if (amx && !vlm_amx_ready()) return -6;
    if (lq == 0) return 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    causal_job_t j;
    memset(&j, 0, sizeof j);
    j.base.d = d, j.base.heads = heads, j.base.scale2 = scale * 1.4426950408889634f;
    j.q = q, j.k = k, j.v = v, j.out = out;
    j.qs = q_stride, j.ks = k_stride, j.vs = v_stride, j.os = out_stride;
    j.lq = lq, j.lk = lk, j.kv_heads = kv_heads, j.group = heads / kv_heads;
    j.qchunks = (lq + QB - 1) / QB, j.kchunks = (lk + QB - 1) / QB;
    j.pq = j.qchunks * QB, j.pk = j.kchunks * QB;
    j.amx = amx != 0, j.dq = amx ? (d + 31) / 32 * 32 : d;
    const size_t qbytes = (size_t)(heads * j.pq * j.dq) * 2, kbytes = (size_t)(kv_heads * j.pk * j.dq) * 2;
    const size_t vbytes = (size_t)(kv_heads * j.pk * d) * 2;
    pool_t *pool = &pools[PREFILL_POOL];
    pthread_mutex_lock(&pool->call);
    uint16_t *buf = scratch_get(pool, qbytes + kbytes + vbytes);
    int rc = buf ? 0 : -4;
    if (rc == 0) { /* every size a multiple of 64 rows × 16 dims × 2 bytes: the three stay 64-byte aligned */
        j.qp = buf, j.kp = buf + qbytes / 2, j.vp = buf + (qbytes + kbytes) / 2;
        j.base.units = j.qchunks + j.kchunks;
        j.base.unit = causal_pack_unit;
        dispatch(pool, &j.base, threads);
        j.base.units = j.qchunks * heads;
#if HAVE_AMX
        j.base.unit = j.amx ? causal_unit_amx : causal_unit;
#else
        j.base.unit = causal_unit;
#endif
        dispatch(pool, &j.base, threads);
    }
    scratch_done(pool);
    pthread_mutex_unlock(&pool->call);
    return rc;
#endif
}

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

/* ---------------------------------------------------------------- entry points */

const char *vlm_varlen_attention_isa(void) { return HAVE_BF16DOT ? "avx512-bf16" : "fp32-fma"; }

/* Segment offsets and the packed buffers (from the pool's scratch: the caller holds pool->call). */
static int plan(job_t *j, int64_t n, pool_t *pool) {
    j->pad = malloc(sizeof(int64_t) * (size_t)(2 * (j->segs + 1)));
    if (!j->pad) return -4;
    j->chunk = j->pad + j->segs + 1;
    j->pad[0] = j->chunk[0] = 0;
    for (int64_t s = 0; s < j->segs; s++) {
        const int64_t len = (int64_t)j->cu[s + 1] - j->cu[s];
        if (len < 0 || j->cu[s + 1] > n) return -5;
        const int64_t chunks = (len + QB - 1) / QB;
        j->pad[s + 1] = j->pad[s] + chunks * QB;
        j->chunk[s + 1] = j->chunk[s] + chunks;
    }
    j->padded = j->pad[j->segs];
    /* multiples of 64 rows × 16 dims × 2 bytes: the three stay 64-byte aligned */
    const size_t bytes = (size_t)(j->heads * j->padded * j->d) * (j->dot ? 2 : 4);
    const size_t qk_bytes = (size_t)(j->heads * j->padded * j->dq) * (j->dot ? 2 : 4);
    char *buf = scratch_get(pool, 2 * qk_bytes + bytes);
    if (!buf) return -4;
    j->qp = buf, j->kp = buf + qk_bytes, j->vp = buf + 2 * qk_bytes;
    return 0;
}

int vlm_varlen_attention(const void *qkv, const float *cos, const float *sin, const int32_t *cu, int64_t segs,
                         void *out, int64_t n, int64_t heads, int64_t d, int64_t dtype, float scale, int64_t threads,
                         int64_t amx) {
    if (d <= 0 || d % 16 || d > MAX_D) return -1;
    if (dtype != 0 && dtype != 1) return -2;
    if (segs < 0 || heads <= 0 || n < 0 || (cos == NULL) != (sin == NULL)) return -3;
    if (amx && (dtype != 1 || !vlm_amx_ready())) return -6;
    if (segs == 0 || n == 0) return 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    job_t j = {qkv, cos, sin, cu, out, segs, heads, d, dtype == 1, HAVE_BF16DOT && dtype == 1, 0, amx != 0,
               amx ? (d + 31) / 32 * 32 : d, scale * 1.4426950408889634f, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0};
    pool_t *pool = &pools[VISION_POOL];
    pthread_mutex_lock(&pool->call);
    int rc = plan(&j, n, pool);
    if (rc == 0) {
        j.units = j.chunk[segs];
#if HAVE_BF16DOT
        j.unit = j.dot ? pack_unit_bf16 : pack_unit;
#else
        j.unit = pack_unit;
#endif
        dispatch(pool, &j, threads);
        j.units = j.chunk[segs] * heads;
        j.unit = attend_unit;
        dispatch(pool, &j, threads);
    }
    scratch_done(pool);
    pthread_mutex_unlock(&pool->call);
    free(j.pad);
    return rc;
}
