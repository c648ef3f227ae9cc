/* A whole decode forward pass of a float32 Llama-style decoder in one call.
 *
 * In Python each of the 30 layers of SmolLM2 makes ~25 torch and kernel calls (norms, the four
 * matmuls, rotary, KV store, attention, the activation, and the views between them); with one
 * row per sequence each call's own cost is most of its time, ~12 ms of a ~75 ms one-token
 * step on this project's AVX2 host. Here the same kernels run in the same order from C
 * (rms_norm, rope, store_kv and paged_decode from cpu_kernels.c, panel_linear from
 * cpu_linear.c), so the result is the Python path's but for the activation (silu by libm's
 * expf instead of torch's vectorised exp: about one unit in the last place). Prefill chunks,
 * bfloat16 models and Qwen3's per-head norms keep the Python path (engine/model.py).
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

enum { F32 = 0 };

/* The kernels this pass strings together (cpu_kernels.c, cpu_linear.c). */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t dim, float eps, int dtype);
void rope(void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
          const int64_t *positions, const float *cos, const float *sin, int dtype);
void store_kv(const void *k, const void *v, void *k_cache, void *v_cache,
              const int64_t *slot_mapping, int64_t num_tokens, int64_t row_len,
              int64_t elem_size, int64_t block_size, int64_t block_stride);
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                 const int32_t *block_tables, const int32_t *context_lens, float *out,
                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                 int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale,
                 int64_t window, float soft_cap, int threads);
void panel_linear(const float *x, const void *panels, int dtype, const float *bias, float *out,
                  int64_t M, int64_t N, int64_t K, int threads);

/* One layer's tensors (model.py's DecoderLayer), as cpu_kernels.DecodeLayer fills them. */
typedef struct {
    const float *qkv, *qkv_bias, *o, *gate_up, *down; /* panels; qkv_bias may be NULL */
    const float *input_norm, *post_norm;
    float *k_cache, *v_cache; /* this layer's (num_blocks, block_size, kv_heads, d) views */
} DecodeLayer;

/* The model's sizes and the step's attention layout. */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t block_size, block_stride, max_blocks, window;
    float eps, scale, soft_cap;
    int threads;
} DecodeShape;

static void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t j = 0; j < inter; j++)
            out[r * inter + j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}

/* x: (M, hidden) embeddings in, final hidden states out. scratch: M * (3 * hidden +
 * (num_heads + 2 * num_kv_heads) * head_dim + 2 * num_heads * head_dim + 3 * intermediate)
 * floats. Returns 0, or -1 when attention could not get its scratch memory. */
int decode_step(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, float *x,
                const float *final_norm, int64_t M, const int64_t *positions,
                const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                const float *cos, const float *sin, float *scratch) {
    int64_t H = s->hidden, I = s->intermediate, d = s->head_dim;
    int64_t q_len = s->num_heads * d, kv_len = s->num_kv_heads * d, row = q_len + 2 * kv_len;
    float *residual = scratch, *h = residual + M * H, *y = h + M * H, *qkv = y + M * H;
    float *q = qkv + M * row, *attn = q + M * q_len, *gate_up = attn + M * q_len;
    float *act = gate_up + M * 2 * I;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *L = &layers[l];
        if (l == 0) {
            memcpy(residual, x, sizeof(float) * M * H);
            rms_norm(x, NULL, L->input_norm, h, M, H, s->eps, F32);
        } else {
            rms_norm(y, residual, L->input_norm, h, M, H, s->eps, F32);
        }
        panel_linear(h, L->qkv, F32, L->qkv_bias, qkv, M, row, H, s->threads);
        rope(qkv, row, M, s->num_heads, d, positions, cos, sin, F32);
        rope(qkv + q_len, row, M, s->num_kv_heads, d, positions, cos, sin, F32);
        for (int64_t t = 0; t < M; t++) {
            const float *k = qkv + t * row + q_len;
            store_kv(k, k + kv_len, L->k_cache, L->v_cache, slots + t, 1, kv_len, sizeof(float),
                     s->block_size, s->block_stride);
            memcpy(q + t * q_len, qkv + t * row, sizeof(float) * q_len);
        }
        if (paged_decode(q, L->k_cache, L->v_cache, F32, block_tables, context_lens, attn, M,
                         s->num_heads, s->num_kv_heads, d, s->block_size, s->block_stride,
                         s->max_blocks, s->scale, s->window, s->soft_cap, s->threads) != 0)
            return -1;
        panel_linear(attn, L->o, F32, NULL, y, M, H, q_len, s->threads);
        rms_norm(y, residual, L->post_norm, h, M, H, s->eps, F32);
        panel_linear(h, L->gate_up, F32, NULL, gate_up, M, 2 * I, H, s->threads);
        silu_and_mul(gate_up, act, M, I);
        panel_linear(act, L->down, F32, NULL, y, M, H, I, s->threads);
    }
    rms_norm(y, residual, final_norm, x, M, H, s->eps, F32);
    return 0;
}
