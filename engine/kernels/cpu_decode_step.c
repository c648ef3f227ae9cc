/* A whole decode forward pass of a Llama-style decoder in one call.
 *
 * In Python each of the 30 layers of SmolLM2 makes ~25 torch and kernel calls (norms, the four
 * matmuls, rotary, KV store, attention, the activation, and the views between them); with one
 * row per sequence each call's own cost is most of its time: a one-token step took 85 ms in
 * Python and 53 ms here, on this project's AVX2 host. The same kernels run in the same order
 * (rms_norm, rope, store_kv, paged_decode and silu_mul from cpu_kernels.c, panel_linear from
 * cpu_linear.c), rounding to bfloat16 wherever the Python path's tensors do, so the result is
 * the Python path's. Prefill chunks and Qwen3's per-head norms keep the Python path
 * (engine/model.py).
 *
 * Per layer, on M decode rows (one per sequence):
 *   h = norm(residual += y)         (the first layer: residual = x, h = norm(x))
 *   qkv = h @ Wqkv + b; rotate q, k; store k, v at their slots; a = attend(q)
 *   y = a @ Wo;  h = norm(residual += y);  y = (silu(h @ Wg) * (h @ Wu)) @ Wd
 * and at the end x = norm(residual + y), the hidden states the LM head reads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_dtypes.h"

/* The kernels this pass strings together (cpu_kernels.c, cpu_linear.c). */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t dim, float eps, int gemma, int dtype);
void rope(void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
          int64_t rotary_dim, const int64_t *positions, const float *cos, const float *sin,
          int dtype);
void store_kv(const void *k, const void *v, void *k_cache, void *v_cache,
              const int64_t *slot_mapping, int64_t num_tokens, int64_t row_len,
              int64_t elem_size, int64_t block_size, int64_t block_stride);
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                 const int32_t *block_tables, const int32_t *context_lens, float *out,
                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                 int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale,
                 int64_t window, float soft_cap, const float *sinks, int threads);
void panel_linear(const float *x, const void *panels, int dtype, const float *bias, float *out,
                  int64_t M, int64_t N, int64_t K, int threads);
void pair_linear(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int threads);
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype);

/* One layer's tensors (model.py's DecoderLayer), as cpu_kernels.DecodeLayer fills them. */
typedef struct {
    const void *qkv;        /* panels, of the model's dtype (bfloat16 pairs: DecodeShape.pairs) */
    const float *qkv_bias;  /* float32, or NULL */
    const void *o, *gate_up, *down;
    const void *input_norm, *post_norm;
    void *k_cache, *v_cache; /* this layer's (num_blocks, block_size, kv_heads, d) views */
} DecodeLayer;

/* The model's sizes and dtype, and the step's attention layout. */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t block_size, block_stride, max_blocks, window;
    float eps, scale, soft_cap;
    int threads, dtype;
    int pairs; /* bfloat16 weights in cpu_linear.c's pairs, multiplied by bfloat16 dot products */
} DecodeShape;

/* The step's buffers, carved out of one scratch allocation: model-dtype tensors (each given a
 * float32's room, so one layout serves both dtypes) and float32 staging for the matmuls. */
typedef struct {
    void *residual, *h, *y, *qkv, *attn, *gate_up, *act;
    float *x32, *out32, *q32, *attn32;
} Buffers;

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

static Buffers carve(float *scratch, const DecodeShape *s, int64_t M) {
    int64_t H = s->hidden, I = s->intermediate, q_len = s->num_heads * s->head_dim;
    int64_t row = q_len + 2 * s->num_kv_heads * s->head_dim;
    Buffers b;
    float *at = scratch;
    b.residual = at, at += M * H;
    b.h = at, at += M * H;
    b.y = at, at += M * H;
    b.qkv = at, at += M * row;
    b.attn = at, at += M * q_len;
    b.gate_up = at, at += M * 2 * I;
    b.act = at, at += M * I;
    b.q32 = at, at += M * q_len;
    b.attn32 = at, at += M * q_len;
    b.x32 = at, at += M * max3(H, I, q_len);
    b.out32 = at;
    return b;
}

/* Floats of scratch that decode_step needs for M rows. */
int64_t decode_step_scratch(const DecodeShape *s, int64_t M) {
    int64_t H = s->hidden, I = s->intermediate, q_len = s->num_heads * s->head_dim;
    int64_t row = q_len + 2 * s->num_kv_heads * s->head_dim;
    return M * (3 * H + row + q_len + 3 * I + 2 * q_len + max3(H, I, q_len) + max3(row, 2 * I, H));
}

/* n values of the model's dtype as float32: in place for float32, else widened into buf. */
static const float *widen(const void *in, int64_t n, int dtype, float *buf) {
    if (dtype == F32) return in;
    for (int64_t i = 0; i < n; i++) buf[i] = from_bf16(((const uint16_t *)in)[i]);
    return buf;
}

/* out (M, N) = in (M, K) @ W.T + bias, rounded to the dtype as Python's `.to(x.dtype)` does. */
static void linear(const void *in, const void *panels, const float *bias, void *out, int64_t M,
                   int64_t N, int64_t K, const DecodeShape *s, const Buffers *b) {
    float *o = s->dtype == F32 ? out : b->out32;
    if (s->pairs)
        pair_linear(in, panels, bias, o, M, N, K, s->threads);
    else
        panel_linear(widen(in, M * K, s->dtype, b->x32), panels, s->dtype, bias, o, M, N, K,
                     s->threads);
    if (s->dtype == BF16)
        for (int64_t i = 0; i < M * N; i++) ((uint16_t *)out)[i] = to_bf16(o[i]);
}

/* Rotate q and k, store k and v at their slots, attend: b->attn (M, num_heads * d). */
static int attention(const DecodeLayer *L, const DecodeShape *s, const Buffers *b, int64_t M,
                     const int64_t *positions, const int64_t *slots, const int32_t *tables,
                     const int32_t *lens, const float *cos, const float *sin) {
    int64_t d = s->head_dim, q_len = s->num_heads * d, kv_len = s->num_kv_heads * d;
    int64_t row = q_len + 2 * kv_len, elem = s->dtype == F32 ? 4 : 2;
    char *qkv = b->qkv;
    rope(qkv, row, M, s->num_heads, d, d, positions, cos, sin, s->dtype);
    rope(qkv + q_len * elem, row, M, s->num_kv_heads, d, d, positions, cos, sin, s->dtype);
    for (int64_t t = 0; t < M; t++) {
        const char *k = qkv + (t * row + q_len) * elem;
        store_kv(k, k + kv_len * elem, L->k_cache, L->v_cache, slots + t, 1, kv_len, elem,
                 s->block_size, s->block_stride);
        for (int64_t i = 0; i < q_len; i++) b->q32[t * q_len + i] = get(qkv, t * row + i, s->dtype);
    }
    if (paged_decode(b->q32, L->k_cache, L->v_cache, s->dtype, tables, lens, b->attn32, M,
                     s->num_heads, s->num_kv_heads, d, s->block_size, s->block_stride,
                     s->max_blocks, s->scale, s->window, s->soft_cap, NULL, s->threads) != 0)
        return -1;
    for (int64_t i = 0; i < M * q_len; i++) put(b->attn, i, b->attn32[i], s->dtype);
    return 0;
}

/* x: (M, hidden) embeddings in, final hidden states out, of the model's dtype. scratch:
 * decode_step_scratch() floats. Returns 0, or -1 when attention could not get its scratch. */
int decode_step(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, void *x,
                const void *final_norm, int64_t M, const int64_t *positions,
                const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                const float *cos, const float *sin, float *scratch) {
    int64_t H = s->hidden, I = s->intermediate, q_len = s->num_heads * s->head_dim;
    int64_t row = q_len + 2 * s->num_kv_heads * s->head_dim;
    Buffers b = carve(scratch, s, M);
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *L = &layers[l];
        if (l == 0) {
            memcpy(b.residual, x, (size_t)(M * H) * (s->dtype == F32 ? 4 : 2));
            rms_norm(x, NULL, L->input_norm, b.h, M, H, s->eps, 0, s->dtype);
        } else {
            rms_norm(b.y, b.residual, L->input_norm, b.h, M, H, s->eps, 0, s->dtype);
        }
        linear(b.h, L->qkv, L->qkv_bias, b.qkv, M, row, H, s, &b);
        if (attention(L, s, &b, M, positions, slots, block_tables, context_lens, cos, sin) != 0)
            return -1;
        linear(b.attn, L->o, NULL, b.y, M, H, q_len, s, &b);
        rms_norm(b.y, b.residual, L->post_norm, b.h, M, H, s->eps, 0, s->dtype);
        linear(b.h, L->gate_up, NULL, b.gate_up, M, 2 * I, H, s, &b);
        silu_mul(b.gate_up, b.act, M, I, s->dtype);
        linear(b.act, L->down, NULL, b.y, M, H, I, s, &b);
    }
    rms_norm(b.y, b.residual, final_norm, x, M, H, s->eps, 0, s->dtype);
    return 0;
}
