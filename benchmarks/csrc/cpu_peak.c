/* The CPU's arithmetic peak, measured: independent chains of one vector instruction per thread, operands in
 * registers, nothing loaded or stored. What no matmul or attention kernel on this machine can exceed.
 *
 *   vlm_peak_gflops(kind, seconds, threads): kind 0 float32 FMA (the widest the build targets),
 *   kind 1 bf16 dot products (vdpbf16ps), kind 2 bf16 AMX tile products (tdpbf16ps on four accumulator
 *   tiles); returns GFLOP/s summed over threads, or -1 where this build (or, for AMX, the kernel) gives no
 *   such instruction. One FMA lane counts 2 flops; one vdpbf16ps lane 4 (two products, two adds); one
 *   tdpbf16ps 16 × 16 × 32 × 2.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

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
#if defined(HAVE_AMX)
    if (job->kind == 2) {
        struct {
            uint8_t palette, start_row, reserved[14];
            uint16_t colsb[16];
            uint8_t rows[16];
        } cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
        __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); /* not _tile_loadconfig: see amx_config in runtime/csrc/cpu_kernel/ */
        /* zeros: the products stay finite (tile numbers are immediates: no loop) */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        t0 = now();
        while (now() - t0 < job->seconds) {
            for (int64_t i = 0; i < block / 16; i++) {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            blocks++;
        }
        _tile_release();
        per_block = (double)(block / 16) * 4 * 16 * 16 * 32 * 2;
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
#if defined(HAVE_AMX)
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: Linux enables the tile state per process on request */
    if (kind == 2 && syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1;
#else
    if (kind == 2) return -1;
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
