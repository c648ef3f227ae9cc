/* A whole decode forward pass in one call, for every architecture the engine serves.
 *
 * In Python each of the 30 layers of SmolLM2 makes ~25 torch and kernel calls (norms, the four
 * matmuls, rotary, KV store, attention, the activation, and the views between them); with one
 * row per sequence each call's own cost is most of its time: a one-token step took 85 ms in
 * Python and 53 ms here, on this project's AVX2 host. The same kernels run in the same order
 * (rms_norm, rms_norm_heads, rope, store_kv, paged_decode, silu_mul / gelu_tanh_mul from
 * cpu_kernels.c, panel_linear / pair_linear from cpu_linear.c, moe_experts from cpu_moe.c),
 * rounding to bfloat16 wherever the Python path's tensors do, so the result is the Python
 * path's (models/cpu_decode.py says which modules map to which fields). Prefill chunks keep
 * the Python path (engine/model.py).
 *
 * On small models the Python step is nearly all call overhead. A step at 1 / 8 / 32
 * sequences of ~200 tokens, one thread, an AVX512-BF16 host (2 cores, shared):
 *   builtin:tiny (Qwen3: q/k norms)   float32 0.24 / 0.85 / 3.3 ms, Python 0.83 / 1.6 / 4.2
 *                                     bfloat16 0.18 / 0.69 / 2.5 ms, Python 1.2 / 1.7 / 3.6
 *   builtin:tiny-qwen3-moe            float32 0.07 / 0.23 / 0.75 ms, Python 0.70 / 0.96 / 1.6
 *                                     bfloat16 0.07 / 0.24 / 0.78 ms, Python 1.1 / 1.4 / 2.0
 *   SmolLM2-135M, before and after the other architectures joined (interleaved runs):
 *                                     float32 16.5-18.3 / 31-33 / 100-103 ms both;
 *                                     bfloat16 10.1-10.3 / 18.5-18.9 / 57-58 ms both
 *
 * Per layer, on M decode rows (one per sequence):
 *   h = in_norm(residual += y)            (the first layer: residual = x, h = in_norm(x))
 *   qkv = h @ Wqkv + b;  q, k normalised per head (Qwen3, Gemma 3);  q, k rotated by this
 *     layer's table (its first rotary_dim values; Gemma 3's local and global bases, Phi-3's
 *     LongRoPE rows);  k, v stored at their slots;  a = attend(q) with this layer's window,
 *     scale, soft cap and sinks
 *   y = a @ Wo + bo;  y = attn_out_norm(y)                   (the second: Gemma's sandwich)
 *   h = mlp_norm(residual += y);  y = mlp(h);  y = mlp_out_norm(y)        (the last: Gemma)
 * where mlp is (act(h @ Wg) * (h @ Wu)) @ Wd, act SiLU or GELU-tanh, or a mixture of experts
 * (cpu_decode_moe.c); and at the end x = norm(residual + y), the hidden states the LM head
 * reads. Every norm is Llama's or, for Gemma, (1 + w) (DecodeShape.gemma). Where the caller
 * hands it DecodeEnds, the step also looks up the token ids' embedding rows first and computes
 * the LM head's logits last (a quantized head, or panels), so that a one-sequence step of a
 * small model is one call from token to logits: the Python around it (the lookup, the head's
 * module call) ran from a cold cache after the weights' stream, ~0.3 ms of a 5 ms step.
 */
#include <string.h>

#include "cpu_decode_step.h"
#include "cpu_dtypes.h"

/* The step's inputs besides the weights. */
typedef struct {
    const int64_t *positions; /* (rows, M): the rotary tables' rows per token; see positions_row */
    const int64_t *slots;
    const int32_t *block_tables, *context_lens;
} StepInputs;

/* Buffers in the order carve lays them out: the int64 ones first, so that they stay aligned. */
enum {
    B_TOPK_IDS, B_TOPK_WORK, B_RESIDUAL, B_H, B_Y, B_QKV, B_ATTN, B_GATE_UP, B_ACT, B_LOGITS,
    B_Q32, B_ATTN32, B_X32, B_OUT32, B_SCORES, B_TOPK_WEIGHTS, B_QUANT, NUM_BUFFERS
};

static int64_t max4(int64_t a, int64_t b, int64_t c, int64_t d) {
    int64_t m = a > b ? a : b;
    m = m > c ? m : c;
    return m > d ? m : d;
}

/* Floats each buffer takes for M rows. */
static void buffer_floats(const DecodeShape *s, int64_t M, int64_t n[NUM_BUFFERS]) {
    int64_t H = s->hidden, I = s->intermediate, q_len = s->num_heads * s->head_dim;
    int64_t row = q_len + 2 * s->num_kv_heads * s->head_dim;
    int64_t E = s->moe.num_experts, k = s->moe.top_k;
    n[B_TOPK_IDS] = 2 * M * k;
    n[B_TOPK_WORK] = 4 * E; /* topk_largest's (value, index) pairs */
    n[B_RESIDUAL] = n[B_H] = n[B_Y] = M * H;
    n[B_QKV] = M * row;
    n[B_ATTN] = n[B_Q32] = n[B_ATTN32] = M * q_len;
    n[B_GATE_UP] = M * 2 * I;
    n[B_ACT] = M * I;
    n[B_LOGITS] = M * E;
    n[B_X32] = M * max4(H, I, q_len, 0);
    n[B_OUT32] = M * max4(row, 2 * I, H, E);
    n[B_SCORES] = E;
    n[B_TOPK_WEIGHTS] = M * k;
    /* the most quant_linear asks for: the widest K, the smallest group */
    n[B_QUANT] = (quant_linear_scratch(M, max4(H, I, q_len, 0), 16) + 3) / 4;
}

static Buffers carve(float *scratch, const DecodeShape *s, int64_t M) {
    int64_t n[NUM_BUFFERS];
    float *at[NUM_BUFFERS];
    buffer_floats(s, M, n);
    for (int i = 0; i < NUM_BUFFERS; scratch += n[i++]) at[i] = scratch;
    return (Buffers){
        .residual = at[B_RESIDUAL], .h = at[B_H], .y = at[B_Y], .qkv = at[B_QKV],
        .attn = at[B_ATTN], .gate_up = at[B_GATE_UP], .act = at[B_ACT], .logits = at[B_LOGITS],
        .x32 = at[B_X32], .out32 = at[B_OUT32], .q32 = at[B_Q32], .attn32 = at[B_ATTN32],
        .scores = at[B_SCORES], .topk_weights = at[B_TOPK_WEIGHTS],
        .topk_ids = (int64_t *)at[B_TOPK_IDS], .topk_work = at[B_TOPK_WORK],
        .quant = at[B_QUANT],
    };
}

/* Floats of scratch that decode_step needs for M rows. */
int64_t decode_step_scratch(const DecodeShape *s, int64_t M) {
    int64_t n[NUM_BUFFERS], total = 0;
    buffer_floats(s, M, n);
    for (int i = 0; i < NUM_BUFFERS; i++) total += n[i];
    return total;
}

/* n values of the model's dtype as float32: in place for float32, else widened into buf. */
static const float *widen(const void *in, int64_t n, int dtype, float *buf) {
    if (dtype == F32) return in;
    for (int64_t i = 0; i < n; i++) buf[i] = from_bf16(((const uint16_t *)in)[i]);
    return buf;
}

/* o (M, N) float32 = in (M, K) @ W.T + bias, through the kernel of W's layout: quantized
 * blocks, bfloat16 pairs or panels. */
static void linear_f32(const void *in, const void *weights, const QuantSpec *q,
                       const float *bias, float *o, int64_t M, int64_t N, int64_t K,
                       const DecodeShape *s, const Buffers *b) {
    if (q != NULL && q->bits != 0)
        quant_linear(in, s->dtype, weights, (int)q->bits, q->group_size, bias, o, M, N, K,
                     s->quant_int8, b->quant, s->threads);
    else if (s->pairs)
        pair_linear(in, weights, bias, o, M, N, K, s->threads);
    else
        panel_linear(widen(in, M * K, s->dtype, b->x32), weights, s->dtype, bias, o, M, N, K,
                     s->threads);
}

void decode_linear(const void *in, const void *weights, const QuantSpec *q, const float *bias,
                   void *out, int64_t M, int64_t N, int64_t K, const DecodeShape *s,
                   const Buffers *b) {
    float *o = s->dtype == F32 ? out : b->out32;
    linear_f32(in, weights, q, bias, o, M, N, K, s, b);
    if (s->dtype == BF16)
        for (int64_t i = 0; i < M * N; i++) ((uint16_t *)out)[i] = to_bf16(o[i]);
}

/* RMSNorm of M rows into out; with a residual, of residual += x (see cpu_kernels.c). */
static void norm(const void *x, void *residual, const void *weight, void *out, int64_t M,
                 const DecodeShape *s) {
    rms_norm(x, residual, weight, out, M, s->hidden, s->eps, s->gemma, s->dtype);
}

/* On b->qkv: q and k normalised per head and rotated, k and v stored at their slots, q
 * attended: b->attn (M, num_heads * d). Returns 0, or -1 when attention had no scratch. */
static int attention(const LayerAttention *A, const DecodeShape *s, const Buffers *b, int64_t M,
                     const StepInputs *in) {
    int64_t d = s->head_dim, q_len = s->num_heads * d, kv_len = s->num_kv_heads * d;
    int64_t row = q_len + 2 * kv_len, elem = s->dtype == F32 ? 4 : 2;
    char *q = b->qkv, *k = q + q_len * elem;
    if (A->q_norm != NULL)
        rms_norm_heads(q, row, M, s->num_heads, d, A->q_norm, s->eps, s->gemma, s->dtype);
    if (A->k_norm != NULL)
        rms_norm_heads(k, row, M, s->num_kv_heads, d, A->k_norm, s->eps, s->gemma, s->dtype);
    const int64_t *positions = in->positions + A->positions_row * M;
    rope(q, row, M, s->num_heads, d, A->rotary_dim, positions, A->cos, A->sin, s->dtype);
    rope(k, row, M, s->num_kv_heads, d, A->rotary_dim, positions, A->cos, A->sin, s->dtype);
    for (int64_t t = 0; t < M; t++) {
        const char *kt = k + t * row * elem;
        store_kv(kt, kt + kv_len * elem, s->dtype, A->k_cache, A->v_cache, s->kv_dtype,
                 in->slots + t, 1, s->num_kv_heads, d, s->block_size, s->block_stride);
        for (int64_t i = 0; i < q_len; i++) b->q32[t * q_len + i] = get(q, t * row + i, s->dtype);
    }
    if (paged_decode(b->q32, A->k_cache, A->v_cache, s->kv_dtype, in->block_tables,
                     in->context_lens, b->attn32, M, s->num_heads, s->num_kv_heads, d,
                     s->block_size, s->block_stride, s->max_blocks, A->scale, A->window,
                     A->soft_cap, A->sinks, s->threads) != 0)
        return -1;
    for (int64_t i = 0; i < M * q_len; i++) put(b->attn, i, b->attn32[i], s->dtype);
    return 0;
}

/* b->y = the MLP of b->h: dense, or the experts. Returns 0, or -1 without memory. */
static int mlp(const LayerMlp *m, const DecodeShape *s, const Buffers *b, int64_t M) {
    if (m->router != NULL) return decode_moe(m, s, b, M);
    int64_t H = s->hidden, I = s->intermediate;
    decode_linear(b->h, m->gate_up, &m->gate_up_quant, NULL, b->gate_up, M, 2 * I, H, s, b);
    if (m->activation == MLP_SILU)
        silu_mul(b->gate_up, b->act, M, I, s->dtype);
    else
        gelu_tanh_mul(b->gate_up, b->act, M, I, s->dtype);
    decode_linear(b->act, m->down, &m->down_quant, NULL, b->y, M, H, I, s, b);
    return 0;
}

/* One layer: b->y and b->residual in (x for the first layer), b->y and b->residual out. */
static int layer(const DecodeLayer *L, const void *first_x, const DecodeShape *s,
                 const Buffers *b, int64_t M, const StepInputs *in) {
    int64_t H = s->hidden, q_len = s->num_heads * s->head_dim;
    int64_t row = q_len + 2 * s->num_kv_heads * s->head_dim;
    if (first_x != NULL) {
        memcpy(b->residual, first_x, (size_t)(M * H) * (s->dtype == F32 ? 4 : 2));
        norm(first_x, NULL, L->input_norm, b->h, M, s);
    } else {
        norm(b->y, b->residual, L->input_norm, b->h, M, s);
    }
    decode_linear(b->h, L->attn.qkv, &L->attn.qkv_quant, L->attn.qkv_bias, b->qkv, M, row, H, s,
                  b);
    if (attention(&L->attn, s, b, M, in) != 0) return -1;
    decode_linear(b->attn, L->attn.o, &L->attn.o_quant, L->attn.o_bias, b->y, M, H, q_len, s, b);
    if (L->attn_out_norm != NULL) norm(b->y, NULL, L->attn_out_norm, b->y, M, s);
    norm(b->y, b->residual, L->mlp_norm, b->h, M, s);
    if (mlp(&L->mlp, s, b, M) != 0) return -1;
    if (L->mlp_out_norm != NULL) norm(b->y, NULL, L->mlp_out_norm, b->y, M, s);
    return 0;
}

/* x = the embedding rows of token_ids (times the multiplier, rounded as the model's dtype
 * rounds a product), as CausalLM.embed makes them. */
static void embed(const DecodeEnds *e, const int64_t *token_ids, void *x, int64_t M,
                  const DecodeShape *s) {
    int64_t H = s->hidden, elem = s->dtype == F32 ? 4 : 2;
    for (int64_t t = 0; t < M; t++) {
        void *row = (char *)x + t * H * elem;
        memcpy(row, (const char *)e->embedding + token_ids[t] * H * elem, (size_t)(H * elem));
        if (e->multiplier != 0.0f)
            for (int64_t i = 0; i < H; i++)
                put(row, i, get(row, i, s->dtype) * e->multiplier, s->dtype);
    }
}

/* logits (M, vocab) float32 = the LM head of x, rounded to the model's dtype and widened
 * again, as CausalLM.logits makes them (lm_head(x).float()). */
static void head_logits(const DecodeEnds *e, const void *x, float *logits, int64_t M,
                        const DecodeShape *s, const Buffers *b) {
    int64_t V = e->vocab;
    linear_f32(x, e->head, &e->head_quant, e->head_bias, logits, M, V, s->hidden, s, b);
    if (s->dtype == BF16)
        for (int64_t i = 0; i < M * V; i++) logits[i] = held(logits[i], BF16);
}

/* x: (M, hidden) embeddings in (times Gemma's multiplier), final hidden states out, of the
 * model's dtype; or, where ends->embedding is set, the embeddings made here from token_ids.
 * Where ends->head is set, logits (M, vocab) float32 out too. ends may be NULL (neither).
 * positions: (rows, M) table rows, one row per distinct way of reading the rotary tables
 * (LayerAttention.positions_row). scratch: decode_step_scratch() floats. Returns 0, or -1
 * when attention or the experts could not get their scratch. */
int decode_step(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s, void *x,
                const void *final_norm, int64_t M, const int64_t *positions,
                const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                float *scratch, const DecodeEnds *ends, const int64_t *token_ids,
                float *logits) {
    Buffers b = carve(scratch, s, M);
    StepInputs in = {positions, slots, block_tables, context_lens};
    if (ends != NULL && ends->embedding != NULL) embed(ends, token_ids, x, M, s);
    for (int64_t l = 0; l < num_layers; l++)
        if (layer(&layers[l], l == 0 ? x : NULL, s, &b, M, &in) != 0) return -1;
    norm(b.y, b.residual, final_norm, x, M, s);
    if (ends != NULL && ends->head != NULL) head_logits(ends, x, logits, M, s, &b);
    return 0;
}
