/* The CPU's arithmetic peak, measured: independent chains of one vector instruction per thread, operands in
 * registers, nothing loaded or stored. What no matmul or attention kernel on this machine can exceed.
 *
 *   vlm_peak_gflops(kind, seconds, threads): kind 0 float32 FMA (the widest the build targets),
 *   kind 1 bf16 dot products (vdpbf16ps); returns GFLOP/s summed over threads, or -1 where this build has
 *   no such instruction. One FMA lane counts 2 flops; one vdpbf16ps lane 4 (two products, two adds).
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#define CHAINS 12

typedef struct {
    int kind;
    double seconds;
    double flops;
    float sink;
} job_t;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#if defined(__AVX512F__)
typedef __m512 vec_t;
#define LANES 16
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static float vsum(vec_t v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec_t;
#define LANES 8
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static float vsum(vec_t v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#endif

static void *run(void *arg) {
    job_t *job = arg;
    const int64_t block = 1 << 16;
    int64_t blocks = 0;
    double t0 = now(), per_block = 0;
#if defined(LANES)
    if (job->kind == 0) {
        vec_t acc[CHAINS];
        vec_t a = VSET1(1.0000001f), b = VSET1(0.9999999f);
        for (int c = 0; c < CHAINS; c++) acc[c] = VSET1((float)c);
        while (now() - t0 < job->seconds) {
            for (int64_t i = 0; i < block; i++)
                for (int c = 0; c < CHAINS; c++) acc[c] = VFMA(acc[c], a, b);
            blocks++;
        }
        float s = 0;
        for (int c = 0; c < CHAINS; c++) s += vsum(acc[c]);
        job->sink = s;
        per_block = (double)block * CHAINS * LANES * 2;
    }
#endif
#if defined(__AVX512BF16__)
    if (job->kind == 1) {
        __m512 acc[CHAINS];
        __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
        while (now() - t0 < job->seconds) {
            for (int64_t i = 0; i < block; i++)
                for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
            blocks++;
        }
        float s = 0;
        for (int c = 0; c < CHAINS; c++) s += _mm512_reduce_add_ps(acc[c]);
        job->sink = s;
        per_block = (double)block * CHAINS * 16 * 4;
    }
#endif
    double dt = now() - t0;
    job->flops = dt > 0 ? blocks * per_block / dt : 0;
    return NULL;
}

double vlm_peak_gflops(int kind, double seconds, int threads) {
#if !defined(__AVX512BF16__)
    if (kind == 1) return -1;
#endif
#if !defined(LANES)
    if (kind == 0) return -1;
#endif
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    pthread_t tid[64];
    job_t jobs[64];
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){.kind = kind, .seconds = seconds};
        if (pthread_create(&tid[t], NULL, run, &jobs[t]) != 0) return -1;
    }
    double total = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        total += jobs[t].flops;
    }
    return total / 1e9;
}
