/* The AMX attention step of runtime/csrc/cpu_kernel/ taken apart: how long a 16-row × 64-key
 * step takes whole, and each of its parts alone, on data that stays in L1/L2 (one 16-row q tile against 1,024
 * keys of head dim 64, four row tiles per key block as attend_unit_amx runs them). benchmarks/amx_step.py
 * appends this file to the kernel's source (its static functions are then in scope) and builds the two as one.
 *
 * Parts (`part`): 0 the whole step (amx_step); 1 the scores and their tile stores; 2 the online softmax of a
 * block; 3 P·V with the accumulators' tile loads and stores; 4 sixteen tile products alone (four independent
 * accumulators, no loads); 5 sixteen tile loads of k and v rows; 6 the sixteen products of 4, then the softmax
 * of 2, with no dependency between them: if the tile unit and the vector units overlapped, 6 would take about
 * the longer of 2 and 4, not their sum. What single tile operations cost: 7 sixteen products chained on one
 * accumulator (against 4's four: whether a product waits for the one before it); 8 sixteen (tile load, product)
 * pairs, each loading the operand the last product read; 9 eight tile stores; 10 sixteen tile loads from k and
 * v of 4,096 keys (1 MB: from L2, where one q tile over every key block would read them). */

#include <time.h>

static double bench_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define BENCH_KEYS 1024

static uint16_t bench_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(u >> 16);
}

#define BENCH_L2_KEYS 4096

#if HAVE_AMX
/* parts 4 and 6: sixteen tile products, four chained on each of four accumulators, on whatever the tiles hold */
static inline void products16(void) {
    for (int r = 0; r < 4; r++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
}
#endif

/* nanoseconds per 16 × 64 step of `part`, the best of `reps` passes over 1,024 keys × 4 row tiles; -1 where
 * this build or process has no AMX tiles */
double vlm_amx_step_ns(int part, int reps) {
#if HAVE_AMX
    if (!vlm_amx_ready()) return -1.0;
    const int64_t d = 64, dq = 64;
    static uint16_t q[16 * 64] __attribute__((aligned(64)));
    static uint16_t k[BENCH_KEYS * 64] __attribute__((aligned(64))), v[BENCH_KEYS * 64] __attribute__((aligned(64)));
    static uint16_t kv2[2 * BENCH_L2_KEYS * 64] __attribute__((aligned(64))); /* part 10's k and v */
    int64_t kv2_at = 0;
    static float Ot[4][64 * TR] __attribute__((aligned(64)));
    static __m512 S[KB];
    static __m512i P[KB / 2];
    unsigned seed = 1;
    for (int i = 0; i < 16 * 64; i++) q[i] = bench_bits((float)(rand_r(&seed) % 2001 - 1000) / 700.0f);
    for (int i = 0; i < BENCH_KEYS * 64; i++) {
        k[i] = bench_bits((float)(rand_r(&seed) % 2001 - 1000) / 700.0f);
        v[i] = bench_bits((float)(rand_r(&seed) % 2001 - 1000) / 700.0f);
    }
    for (int i = 0; i < KB; i++) S[i] = _mm512_set1_ps((float)(i % 13) - 6.0f);
    for (int64_t i = 0; i < 2 * BENCH_L2_KEYS * 64; i++) kv2[i] = k[i % (BENCH_KEYS * 64)];
    __m512 m[4], l[4];
    double best = 1e30;
    amx_config();
    for (int rep = 0; rep < reps; rep++) {
        for (int t = 0; t < 4; t++) m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
        const double t0 = bench_now();
        for (int64_t k0 = 0; k0 < BENCH_KEYS; k0 += KB)
            for (int t = 0; t < 4; t++) {
                const uint16_t *kb = k + k0 * dq, *vb = v + k0 * d;
                if (part == 0) {
                    amx_step(q, kb, vb, d, dq, KB, NULL, 0.18f, m + t, l + t, Ot[t], k0 == 0, k0 > 0);
                } else if (part == 1) {
                    amx_scores(q, kb, dq);
                    _tile_stored(0, S, 64);
                    _tile_stored(1, S + 16, 64);
                    _tile_stored(2, S + 32, 64);
                    _tile_stored(3, S + 48, 64);
                } else if (part == 2 || part == 6) {
                    if (part == 6) products16();
                    softmax_tile(S, KB, NULL, 0.18f, m + t, l + t, P, k0 > 0);
                } else if (part == 3) {
                    float *o = Ot[t];
                    const int two = 1, fresh = 0;
                    _tile_loadd(6, P, 64);
                    _tile_loadd(7, P + 16, 64);
#define Ot o
                    PV_TILE(0, 0);
                    PV_TILE(1, 1);
                    PV_TILE(2, 2);
                    PV_TILE(3, 3);
#undef Ot
                } else if (part == 4) {
                    products16();
                } else if (part == 7) {
                    for (int r = 0; r < 16; r++) _tile_dpbf16ps(0, 4, 6);
                } else if (part == 8) {
                    for (int r = 0; r < 16; r += 2) {
                        _tile_loadd(7, k + r * 16 * 32, 64);
                        _tile_dpbf16ps(0, 7, 4);
                        _tile_loadd(7, k + (r + 1) * 16 * 32, 64);
                        _tile_dpbf16ps(1, 7, 4);
                    }
                } else if (part == 9) {
                    for (int r = 0; r < 8; r += 2) {
                        _tile_stored(0, Ot[0] + (r & 3) * 256, 64);
                        _tile_stored(1, Ot[0] + ((r + 1) & 3) * 256, 64);
                    }
                } else if (part == 10) {
                    for (int r = 0; r < 16; r++) {
                        _tile_loadd(7, kv2 + kv2_at, 64);
                        kv2_at = (kv2_at + 16 * 32) % (2 * BENCH_L2_KEYS * 64);
                    }
                } else if (part == 5) {
                    for (int r = 0; r < 4; r++) {
                        _tile_loadd(4, kb + r * 16 * dq, dq * 2);
                        _tile_loadd(5, kb + r * 16 * dq + 32, dq * 2);
                        _tile_loadd(6, vb + r * 16 * KB, KB * 2);
                        _tile_loadd(7, vb + r * 16 * KB + 32, KB * 2);
                    }
                }
                __asm__ volatile("" ::"r"(S), "r"(P), "r"(Ot) : "memory");
            }
        const double dt = bench_now() - t0;
        if (dt < best) best = dt;
    }
    _tile_release();
    return best / (BENCH_KEYS / KB * 4) * 1e9;
#else
    (void)part, (void)reps;
    return -1.0;
#endif
}
