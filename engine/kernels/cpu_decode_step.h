/* The one-call decode step's records and the kernels it strings together, shared by
 * cpu_decode_step.c (the layers, attention, the dense MLP) and cpu_decode_moe.c (a mixture of
 * experts' router and experts). cpu_kernels.py's ctypes Structures mirror these records field
 * for field: change both together.
 */
#ifndef PDCLUSTER_CPU_DECODE_STEP_H
#define PDCLUSTER_CPU_DECODE_STEP_H
#include <stdint.h>

/* cpu_kernels.c */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t dim, float eps, int gemma, int dtype);
void rms_norm_heads(void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
                    const void *weight, float eps, int gemma, int dtype);
void rope(void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
          int64_t rotary_dim, const int64_t *positions, const float *cos, const float *sin,
          int dtype);
void store_kv(const void *k, const void *v, int src_dtype, void *k_cache, void *v_cache,
              int dtype, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
              int64_t d, int64_t block_size, int64_t block_stride);
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                 const int32_t *block_tables, const int32_t *context_lens, float *out,
                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                 int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale,
                 int64_t window, float soft_cap, const float *sinks, int threads);
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype);
void gelu_tanh_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype);
/* cpu_linear.c */
void panel_linear(const float *x, const void *panels, int dtype, const float *bias, float *out,
                  int64_t M, int64_t N, int64_t K, int threads);
void pair_linear(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int threads);
/* cpu_moe.c */
int moe_experts(const void *x, const int64_t *topk_ids, const float *topk_weights,
                const void *gate_up, const void *down, const float *gate_up_bias,
                const float *down_bias, void *out, int64_t tokens, int64_t top_k, int64_t E,
                int64_t H, int64_t I, int dtype, int pairs, int activation, float alpha,
                float limit, int64_t chunk_bytes, int threads);
/* cpu_quant.c: weight-only quantized matrices (engine/kernels/cpu_quant.py packs them) */
int quant_linear(const void *x, int dtype, const uint8_t *packed, int bits, int64_t G,
                 const float *bias, float *out, int64_t M, int64_t N, int64_t K, int int8,
                 void *scratch, int threads);
int64_t quant_linear_scratch(int64_t M, int64_t K, int64_t G);
/* cpu_topk.cpp: the k largest of x (n) in torch.topk's order; work: n * 16 bytes */
void topk_largest(const float *x, int64_t n, int64_t k, void *work, float *values,
                  int64_t *ids);

enum { MLP_SILU = 0, MLP_GELU_TANH = 1 };          /* a dense MLP's activation */
enum { TOPK_SOFTMAX = 0, SOFTMAX_TOPK = 1 };       /* a router's order (MoeConfig.routing) */

/* How a matrix is stored: bits 0, in the step's float layout (DecodeShape.pairs); 4 or 8,
 * weight-only quantized in groups of group_size along K, as cpu_quant.c packs them. */
typedef struct {
    int64_t bits, group_size;
} QuantSpec;

/* Attention's tensors (layers.Attention) and this layer's own settings. */
typedef struct {
    const void *qkv;            /* panels or pairs of the model's dtype (DecodeShape.pairs) */
    const float *qkv_bias;      /* float32, or NULL */
    const void *q_norm, *k_norm; /* per-head RMSNorm weights (head_dim,), or NULL */
    const void *o;
    const float *o_bias;        /* float32, or NULL (gpt-oss has one) */
    const float *sinks;         /* (num_heads,) float32 logits, or NULL (gpt-oss) */
    const float *cos, *sin;     /* this layer's rotary table: (positions, rotary_dim) float32 */
    void *k_cache, *v_cache;    /* this layer's (num_blocks, block_size, kv_heads, d) views */
    int64_t rotary_dim;         /* the first rotary_dim values of a head rotate */
    int64_t positions_row;      /* the row of decode_step's table positions this table reads */
    int64_t window;             /* sliding window, 0: none */
    float scale, soft_cap;      /* soft_cap 0: none */
    QuantSpec qkv_quant, o_quant;
} LayerAttention;

/* The MLP: dense (gate_up, down) or a mixture of experts (router not NULL). */
typedef struct {
    const void *gate_up, *down; /* panels or pairs */
    const void *router;         /* panels or pairs, (num_experts, hidden) */
    const float *router_bias;
    const void *experts_gate_up, *experts_down; /* as cpu_kernels.pack_experts left them */
    const float *experts_gate_up_bias, *experts_down_bias;
    int64_t activation;         /* dense: MLP_SILU or MLP_GELU_TANH */
    QuantSpec gate_up_quant, down_quant;
} LayerMlp;

/* One layer. Norms before attention and before the MLP add the residual first; the two on
 * their outputs (Gemma's sandwich) are NULL elsewhere. */
typedef struct {
    LayerAttention attn;
    const void *input_norm, *attn_out_norm, *mlp_norm, *mlp_out_norm;
    LayerMlp mlp;
} DecodeLayer;

/* The mixture of experts' settings, every MoE layer's (engine.model_config.MoeConfig). */
typedef struct {
    int64_t num_experts, top_k, intermediate, chunk_bytes;
    int64_t routing, renormalize, activation, pairs; /* activation: cpu_moe.c's ACT_* */
    float alpha, limit;
} MoeShape;

/* The model's sizes and dtype, and the step's attention layout. */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t block_size, block_stride, max_blocks;
    float eps;
    int threads, dtype;
    int pairs; /* bfloat16 weights in cpu_linear.c's pairs, multiplied by bfloat16 dot products */
    int gemma; /* every RMSNorm is Gemma's (1 + w) */
    MoeShape moe;
    int quant_int8; /* quantized matrices take int8 activations (cpu_quant.c's VNNI path) */
    int kv_dtype;   /* the KV cache's: F32, BF16 or cpu_kernels.c's I8 (kv_quant.py's rows) */
} DecodeShape;

/* The step's two ends where it takes them too (cpu_decode.decode_tokens_in_c): the token ids'
 * embedding rows in, and the LM head's logits out. */
typedef struct {
    const void *embedding; /* (vocab, hidden) of the model's dtype; NULL: x comes in embedded */
    float multiplier;      /* the rows times this (Gemma's, held in the model's dtype); 0: none */
    const void *head;      /* the LM head as decode_linear reads a layer's; NULL: no logits */
    const float *head_bias;
    QuantSpec head_quant;
    int64_t vocab;
} DecodeEnds;

/* The step's buffers, carved out of one scratch allocation: model-dtype tensors (each given a
 * float32's room, so one layout serves both dtypes), float32 staging for the matmuls, and the
 * router's results. */
typedef struct {
    void *residual, *h, *y, *qkv, *attn, *gate_up, *act, *logits;
    float *x32, *out32, *q32, *attn32, *scores, *topk_weights;
    int64_t *topk_ids;
    void *topk_work, *quant; /* quant: quant_linear's scratch */
} Buffers;

/* out (M, N) = in (M, K) @ W.T + bias, rounded to the dtype as Python's `.to(x.dtype)` does. */
void decode_linear(const void *in, const void *weights, const QuantSpec *q, const float *bias,
                   void *out, int64_t M, int64_t N, int64_t K, const DecodeShape *s,
                   const Buffers *b);
/* b->y = the layer's mixture of experts on b->h; 0, or -1 when its buffers could not be had. */
int decode_moe(const LayerMlp *m, const DecodeShape *s, const Buffers *b, int64_t M);
#endif
