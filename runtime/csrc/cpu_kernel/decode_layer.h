/* A section of cpu_kernel.c's one translation unit (included there, in order): not compiled alone. */

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
    if ((rc = vlm_rms_norm(xs, L->in_norm, h, m, hd, L->eps, 1, 1, 0))) return rc;
    if ((rc = L->linear(h, m, hd, hd, L->w[0], nqkv, L->bias[0], qkv, nqkv, lt, L->paths[0]))) return rc;
    if ((rc = vlm_rope_heads(qkv, S->cos, S->sin, L->q_norm, L->k_norm, m, nqkv, L->heads + L->kv_heads, L->heads, d,
                             L->qk_eps, 1, 0)))
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
    if ((rc = vlm_rms_norm(xs, L->post_norm, h, m, hd, L->eps, 1, 1, 0))) return rc;
    if ((rc = L->linear(h, m, hd, hd, L->w[2], 2 * L->inter, NULL, gu, 2 * L->inter, lt, L->paths[2]))) return rc;
    if ((rc = vlm_silu_mul(gu, gu + L->inter, act, m, L->inter, 2 * L->inter, 1, 1, 0))) return rc;
    if ((rc = L->linear(act, m, L->inter, L->inter, L->w[3], hd, NULL, o, hd, lt, L->paths[3]))) return rc;
    add_rows_bf16(xs, o, m * hd);
    return 0;
}
