/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

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

/* An elementwise job's `units` on `pool` (VISION_POOL: the tower's kernels share it; PREFILL_POOL: the decoder's
 * prefill chunks, which must not queue behind a tower call on the encoder thread); returns 0, or -5 for no such
 * pool. */
static int run_elementwise(job_t *j, int64_t units, void (*unit)(job_t *, int64_t), int64_t threads, int64_t pool_id) {
    if (pool_id < 0 || pool_id >= POOLS) return -5;
    j->units = units;
    j->unit = unit;
    if (threads <= 1 || units <= 1) {
        /* on the caller alone, without a pool: a decode step's norm or silu · up (a few rows) must not wait for
         * another thread's call, and needs no other thread */
        atomic_store(&j->next, 0);
        work(j);
        return 0;
    }
    pool_t *pool = &pools[pool_id];
    pthread_mutex_lock(&pool->call);
    dispatch(pool, j, threads > MAX_THREADS ? MAX_THREADS : threads);
    pthread_mutex_unlock(&pool->call);
    return 0;
}

/* gelu with the tanh approximation, 0.5·y·(1 + tanh(k·(y + 0.044715·y³))), k = sqrt(2/π), written as
 * y · sigmoid(2k·(y + 0.044715·y³)) = y / (1 + 2^t), t = -2k·(y + 0.044715·y³) · log2 e (clamped as y_sigmoid_v):
 * Qwen3-VL's tower MLP (`gelu_pytorch_tanh`). The same value in exact arithmetic; torch's tanh form cancels for
 * negative y (1 + tanh(u) near 0), this one does not, and elsewhere they differ in float32's last bits. */
static inline vf gelu_tanh_v(vf y) {
    vf t = y * (1.0f + 0.044715f * y * y) * (2.0f * 0.7978845608028654f * -1.4426950408889634f);
    t = vselect(t > vsplat(126.0f), vsplat(126.0f), t);
    return y / (1.0f + exp2_v(t));
}

#if HAVE_BF16DOT
static inline __m512 gelu_tanh_512(__m512 y) {
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(y, y), _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.0f));
    const __m512 t = _mm512_min_ps(
        _mm512_mul_ps(_mm512_mul_ps(y, inner), _mm512_set1_ps(2.0f * 0.7978845608028654f * -1.4426950408889634f)),
        _mm512_set1_ps(126.0f));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp2_512(t));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(y, inv);
}
#endif

/* x = act(x + bias) in place, in float32, rounded once (to nearest even, as f32_to_bf16); rows [16u, 16u + 16).
 * `tanh_form`: gelu_tanh, else quick_gelu; a constant where the two units below inline it. */
static inline __attribute__((always_inline)) void act_rows(const act_job_t *j, int64_t u, const int tanh_form) {
    const int64_t r1 = (u + 1) * ACT_ROWS < j->rows ? (u + 1) * ACT_ROWS : j->rows, cols = j->cols;
    for (int64_t r = u * ACT_ROWS; r < r1; r++) {
        int64_t c0 = 0;
#if HAVE_BF16DOT
        if (j->bf16) /* 16 lanes, exp2_512 and a refined reciprocal: twice the rate of the generic vectors below */
            for (; c0 + 16 <= cols; c0 += 16) {
                uint16_t *x = (uint16_t *)j->x + r * cols + c0;
                __m512 y = widen_bf16(x);
                if (j->bias) y = _mm512_add_ps(y, widen_bf16((const uint16_t *)j->bias + c0));
                _mm256_storeu_si256((__m256i *)x, bf16_16(tanh_form ? gelu_tanh_512(y) : y_sigmoid_512(y, 1.702f)));
            }
#endif
        for (; c0 + VW <= cols; c0 += VW) {
            const int64_t i = r * cols + c0;
            const vf y = load_elems(j->x, i, j->bf16) + (j->bias ? load_elems(j->bias, c0, j->bf16) : vsplat(0.0f));
            store_elems(j->x, i, tanh_form ? gelu_tanh_v(y) : y_sigmoid_v(y, 1.702f), j->bf16);
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
        v = tanh_form ? gelu_tanh_v(v) : y_sigmoid_v(v, 1.702f);
        for (int64_t e = 0; c0 + e < cols; e++) {
            const int64_t i = r * cols + c0 + e;
            if (j->bf16) ((uint16_t *)j->x)[i] = f32_to_bf16(v[e]);
            else ((float *)j->x)[i] = v[e];
        }
    }
}

static void quick_gelu_unit(job_t *jb, int64_t u) { act_rows((const act_job_t *)jb, u, 0); }
static void gelu_tanh_unit(job_t *jb, int64_t u) { act_rows((const act_job_t *)jb, u, 1); }

int vlm_bias_quick_gelu(void *x, const void *bias, int64_t rows, int64_t cols, int64_t dtype, int64_t threads) {
    if (dtype != 0 && dtype != 1) return -2;
    if (rows < 0 || cols <= 0) return -3;
    act_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.bias = bias, j.rows = rows, j.cols = cols, j.bf16 = dtype == 1;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, quick_gelu_unit, threads, VISION_POOL);
}

/* x [rows, cols] = gelu_tanh(x) in place (float32 or bfloat16), on the vision pool. */
int vlm_gelu_tanh(void *x, int64_t rows, int64_t cols, int64_t dtype, int64_t threads) {
    if (dtype != 0 && dtype != 1) return -2;
    if (rows < 0 || cols <= 0) return -3;
    act_job_t j;
    memset(&j, 0, sizeof j);
    j.x = x, j.rows = rows, j.cols = cols, j.bf16 = dtype == 1;
    return run_elementwise(&j.base, (rows + ACT_ROWS - 1) / ACT_ROWS, gelu_tanh_unit, threads, VISION_POOL);
}
