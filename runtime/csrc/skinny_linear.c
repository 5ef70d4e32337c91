/* Few-row bfloat16 linear layers (decode steps: one row per running sequence) on the weight oneDNN already
 * packed, so a decode step reads every weight once at the memory's rate and the prefill keeps oneDNN's kernels
 * on the same buffer: no second copy of any weight.
 *
 * y [m, n] = x [m, k] · wᵀ (+ bias), bfloat16 in and out, float32 accumulation, m <= 16. w is the buffer that
 * torch.ops.mkldnn._reorder_linear_weight produced for a bfloat16 [n, k] weight: pairs of k interleaved, B
 * outputs a block, [n/B][k/2][B][2], B = 32 on a CPU with AMX and 64 on AVX512-BF16 CPUs without it (the Python
 * side checks the layout on every weight it hands here, runtime/linear.py). Each block is one contiguous
 * run of k · 2B bytes, read once.
 *
 * Two paths over the same layout. AMX (`path` 1): per 32 · k block, tiles C [m][16 outputs] += x [m][32 k] (A,
 * read in place, rows ldx apart) · w [16 k pairs][16 outputs][2] (B, rows of the block 128 bytes apart), two
 * blocks at a time (four accumulators). AVX512-BF16 (`path` 2 on 32-output blocks, 3 on 64): per block,
 * vdpbf16ps of a k pair of x (broadcast) against the block's outputs, eight (four) rows of x at a time.
 *
 * NOTE: oneDNN's own call on this buffer for one to a few rows ran 10-25 % under the machine's read rate at the
 * Qwen2-VL-2B decoder's shapes, and its 8,960 → 1,536 projection at one row 5x slower (it splits k): 2-vCPU Xeon
 * with AMX, 2026-12-06, benchmarks/real_size.py and the step of linears in the commit that added this file.
 *
 * Built by runtime/linear.py with -fopenmp where the compiler can (the calls then run on torch's own
 * OpenMP threads); called through ctypes, which releases the GIL. Returns 0, or a negative code for arguments or
 * a path it refuses.
 */
#include <stdint.h>
#include <string.h>

#include "isa.h"

#define BLOCK 32 /* outputs per block of the layout oneDNN packs on AMX (the AMX path reads only that one) */
#define MAX_ROWS 16

#if HAVE_AMX

/* Tiles 0-3: accumulators [m][16 outputs]; 4: x's 32 columns [m][32]; 5-7: the weight's [16 pairs][16][2]. */
static void amx_config(int64_t m) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 5; i++) c.colsb[i] = 64, c.rows[i] = (uint8_t)m;
    for (int i = 5; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    /* NOTE: an asm operand of all 64 bytes, not _tile_loadconfig (GCC 12 declares 8, and the stores to the rest
     * can go as dead where it is inlined), as in runtime/csrc/cpu_kernel/attention_products.h */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}
#endif

int vlm_skinny_amx_ready(void) { return amx_granted(); }

int vlm_skinny_bf16dot(void) { return HAVE_BF16DOT; }

#if HAVE_BF16DOT
/* float32 → bfloat16, 16 lanes, round to nearest even (vcvtneps2bf16, as oneDNN's own kernels convert) */
static inline void store_bf16(uint16_t *dst, __m512 v) {
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Row i of the accumulators `acc` ([MAX_ROWS][cols] float32) plus the bias, rounded, into y. */
static inline void write_rows(const float *acc, int64_t ldacc, int64_t m, int64_t cols, const uint16_t *bias,
                              uint16_t *y, int64_t ldy) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < cols; j += 16) {
            __m512 v = _mm512_loadu_ps(acc + i * ldacc + j);
            if (bias)
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + j))), 16)));
            store_bf16(y + i * ldy + j, v);
        }
}
#endif

#if HAVE_AMX
/* Blocks [b0, b1) (of 32 outputs), two at a time. */
static void unit_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                     uint16_t *y, int64_t ldy, int64_t b0, int64_t b1) {
    amx_config(m);
    float out[MAX_ROWS][2 * BLOCK];
    for (int64_t b = b0; b < b1; b += 2) {
        const int two = b + 1 < b1;
        const uint16_t *w0 = w + b * BLOCK * k, *w1 = w0 + BLOCK * k;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < k; kc += 32) {
            _tile_loadd(4, x + kc, ldx * 2);
            const uint16_t *p0 = w0 + kc * BLOCK; /* k pairs kc/2 ..: rows of 32 outputs × 2, 128 bytes */
            _tile_loadd(5, p0, 128);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, p0 + 32, 128);
            _tile_dpbf16ps(1, 4, 6);
            if (two) {
                const uint16_t *p1 = w1 + kc * BLOCK;
                _tile_loadd(7, p1, 128);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, p1 + 32, 128);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, &out[0][0], sizeof out[0]);
        _tile_stored(1, &out[0][16], sizeof out[0]);
        if (two) {
            _tile_stored(2, &out[0][32], sizeof out[0]);
            _tile_stored(3, &out[0][48], sizeof out[0]);
        }
        write_rows(&out[0][0], 2 * BLOCK, m, two ? 2 * BLOCK : BLOCK, bias ? bias + b * BLOCK : NULL,
                   y + b * BLOCK, ldy);
    }
    _tile_release();
}
#endif

#if HAVE_BF16DOT
/* Per row i < 8 and vector v < 4 of a block: the statement S(i, v), dropped by the compiler where i >= ROWS or
 * v >= B/16 (both constants where block_dot is inlined). */
#define EACH_V(S, i) S(i, 0) S(i, 1) S(i, 2) S(i, 3)
#define EACH_IV(S) EACH_V(S, 0) EACH_V(S, 1) EACH_V(S, 2) EACH_V(S, 3) EACH_V(S, 4) EACH_V(S, 5) EACH_V(S, 6) EACH_V(S, 7)
#define EACH_I(S) S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7)
#define ACC_ZERO(i, v) __m512 a##i##v = _mm512_setzero_ps();
#define W_LOAD(v) if (v < B / 16) w##v = (__m512bh)_mm512_loadu_si512(wp + v * 32);
#define X_PAIR(i)                                                                                                    \
    if (i < ROWS) {                                                                                                  \
        uint32_t pair;                                                                                               \
        memcpy(&pair, x + i * ldx + 2 * p, 4);                                                                       \
        x##i = (__m512bh)_mm512_set1_epi32((int)pair);                                                               \
    }
#define ACC_DOT(i, v) if (i < ROWS && v < B / 16) a##i##v = _mm512_dpbf16_ps(a##i##v, w##v, x##i);
#define ACC_STORE(i, v) if (i < ROWS && v < B / 16) _mm512_storeu_ps(out[i] + 16 * v, a##i##v);

/* out [ROWS][64] = ROWS rows of x · one block of `B` outputs (32 or 64: the layout's block) by vdpbf16ps: per k pair,
 * x's pair (two bf16 as one 32-bit lane, broadcast) against the block's B outputs. Called with constants only, and
 * every accumulator a variable of its own: with arrays indexed in loops GCC 12 kept them on the stack (a load and a
 * store per product: at 4 and 16 rows the Zen 4 ran at a third of oneDNN's rate). */
static inline __attribute__((always_inline)) void block_dot(const uint16_t *x, int64_t ldx, int64_t k,
                                                            const uint16_t *wb, float (*out)[64], const int B,
                                                            const int ROWS) {
    EACH_IV(ACC_ZERO)
    __m512bh w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7;
    w0 = w1 = w2 = w3 = x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = (__m512bh)_mm512_setzero_si512();
    for (int64_t p = 0; p < k / 2; p++) {
        const uint16_t *wp = wb + p * 2 * B;
        W_LOAD(0) W_LOAD(1) W_LOAD(2) W_LOAD(3)
        EACH_I(X_PAIR)
        EACH_IV(ACC_DOT)
    }
    EACH_IV(ACC_STORE)
}

/* One row of x · one block of `B` outputs, k's pairs in two halves read side by side (two streams of the block
 * from memory at once, two sets of accumulators added at the end). NOTE: a decode step's linears at the 2B shape,
 * 2-vCPU Zen 4, benchmarks/skinny_linear.py --rows 1, alternating builds: 1.00-1.01x the time of a plain read of
 * the same bytes in three runs, against 1.04-1.05x reading each block as one stream (at a slow hour of the VM's
 * memory, 32-35 GB/s; at 55 GB/s one stream ran at 1.19x, and this was not measured there). */
static inline __attribute__((always_inline)) void block_dot1_split(const uint16_t *x, int64_t k, const uint16_t *wb,
                                                                   float (*out)[64], const int B) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const int64_t pairs = k / 2, h = pairs / 2;
    for (int64_t p = 0; p < h; p++) {
        const uint16_t *wp = wb + p * 2 * B, *wq = wb + (p + h) * 2 * B;
        uint32_t pa, pb;
        memcpy(&pa, x + 2 * p, 4);
        memcpy(&pb, x + 2 * (p + h), 4);
        const __m512bh xa = (__m512bh)_mm512_set1_epi32((int)pa), xb = (__m512bh)_mm512_set1_epi32((int)pb);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wp), xa);
        c0 = _mm512_dpbf16_ps(c0, (__m512bh)_mm512_loadu_si512(wq), xb);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wp + 32), xa);
        c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512(wq + 32), xb);
        if (B == 64) {
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wp + 64), xa);
            c2 = _mm512_dpbf16_ps(c2, (__m512bh)_mm512_loadu_si512(wq + 64), xb);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wp + 96), xa);
            c3 = _mm512_dpbf16_ps(c3, (__m512bh)_mm512_loadu_si512(wq + 96), xb);
        }
    }
    if (pairs % 2) { /* the odd pair out, at the end */
        const uint16_t *wp = wb + (pairs - 1) * 2 * B;
        uint32_t pa;
        memcpy(&pa, x + 2 * (pairs - 1), 4);
        const __m512bh xa = (__m512bh)_mm512_set1_epi32((int)pa);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wp), xa);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wp + 32), xa);
        if (B == 64) {
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wp + 64), xa);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wp + 96), xa);
        }
    }
    _mm512_storeu_ps(out[0], _mm512_add_ps(a0, c0));
    _mm512_storeu_ps(out[0] + 16, _mm512_add_ps(a1, c1));
    if (B == 64) {
        _mm512_storeu_ps(out[0] + 32, _mm512_add_ps(a2, c2));
        _mm512_storeu_ps(out[0] + 48, _mm512_add_ps(a3, c3));
    }
}

/* Blocks [b0, b1) of `B` outputs, `R` rows of x a pass (R · B/16 accumulators, the block's B/16 vectors and a
 * broadcast in the 32 registers); the last pass's rows picked by a switch, so every count has its own loop. */
static inline __attribute__((always_inline)) void unit_dot(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                                                           const uint16_t *w, const uint16_t *bias, uint16_t *y,
                                                           int64_t ldy, int64_t b0, int64_t b1, const int B,
                                                           const int R) {
    float out[8][64];
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t *wb = w + b * B * k;
        for (int64_t r0 = 0; r0 < m; r0 += R) {
            const int64_t rows = m - r0 < R ? m - r0 : R;
            const uint16_t *xr = x + r0 * ldx;
            switch (rows) { /* R >= rows: the cases past R are never reached (and compile as one row) */
            case 1:
                block_dot1_split(xr, k, wb, out, B);
                break;
            case 2: block_dot(xr, ldx, k, wb, out, B, 2); break;
            case 3: block_dot(xr, ldx, k, wb, out, B, 3); break;
            case 4: block_dot(xr, ldx, k, wb, out, B, 4); break;
            case 5: block_dot(xr, ldx, k, wb, out, B, R >= 5 ? 5 : 1); break;
            case 6: block_dot(xr, ldx, k, wb, out, B, R >= 6 ? 6 : 1); break;
            case 7: block_dot(xr, ldx, k, wb, out, B, R >= 7 ? 7 : 1); break;
            default: block_dot(xr, ldx, k, wb, out, B, R >= 8 ? 8 : 1); break;
            }
            write_rows(&out[0][0], 64, rows, B, bias ? bias + b * B : NULL, y + r0 * ldy + b * B, ldy);
        }
    }
}

static void unit_dot32(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                       uint16_t *y, int64_t ldy, int64_t b0, int64_t b1) {
    unit_dot(x, m, k, ldx, w, bias, y, ldy, b0, b1, 32, 8);
}

static void unit_dot64(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                       uint16_t *y, int64_t ldy, int64_t b0, int64_t b1) {
    unit_dot(x, m, k, ldx, w, bias, y, ldy, b0, b1, 64, 6);
}
#endif

/* path 1: AMX (vlm_skinny_amx_ready()) on 32-output blocks; 2: AVX512-BF16 dot products on 32-output blocks; 3: the
 * same on 64-output blocks ([n/64][k/2][64][2], the layout oneDNN packs on AVX512-BF16 CPUs without AMX, a Zen 4
 * EPYC's). k a multiple of 32 and n of the block (no padding to read past), 1 <= m <= 16, x's rows ldx >= k apart,
 * y's ldy >= n. */
int vlm_skinny_linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w, int64_t n,
                      const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t threads, int64_t path) {
    const int64_t block = path == 3 ? 64 : 32;
    if (m < 1 || m > MAX_ROWS || k <= 0 || k % 32 || n <= 0 || n % block || ldx < k || ldy < n) return -1;
    if (path == 1 && !vlm_skinny_amx_ready()) return -2;
    if (path != 1 && ((path != 2 && path != 3) || !HAVE_BF16DOT)) return -2;
#if HAVE_BF16DOT
    const int64_t blocks = n / block;
    /* units of 64 outputs: 64 · k · 2 bytes each (196 KB at k 1,536), a few dozen at the smallest layer, handed
     * out one at a time: where a neighbour slows one vCPU the other takes more (with a static split the start-up
     * probe lost to oneDNN in 1 of 3 runs during a test suite on the other vCPU; dynamic won 3 of 3, and on a
     * quiet machine the 2B step's linears took 106.9 ms against oneDNN's 113.3, benchmarks/skinny_linear.py) */
    const int64_t per = 64 / block, units = (blocks + per - 1) / per;
    if (threads < 1) threads = 1;
    if (threads > units) threads = units;
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) schedule(dynamic, 1)
#endif
    for (int64_t u = 0; u < units; u++) {
        const int64_t b0 = u * per, b1 = b0 + per < blocks ? b0 + per : blocks;
#if HAVE_AMX
        if (path == 1) {
            unit_amx(x, m, k, ldx, w, bias, y, ldy, b0, b1);
            continue;
        }
#endif
        if (path == 3) unit_dot64(x, m, k, ldx, w, bias, y, ldy, b0, b1);
        else unit_dot32(x, m, k, ldx, w, bias, y, ldy, b0, b1);
    }
    return 0;
#else
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)threads;
    return -2;
#endif
}
