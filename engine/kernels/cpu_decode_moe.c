/* A mixture-of-experts layer inside the one-call decode step (Qwen3-MoE, Mixtral, gpt-oss):
 * moe.py's SparseMoE.route, then cpu_moe.c's grouped experts, each expert's weights read once
 * per step (its expert_passes counter counts them as for the Python path's calls).
 *
 *   logits = h @ Wr + br                     the model's dtype, as the router's Linear rounds
 *   SOFTMAX_TOPK (Qwen3-MoE, Mixtral):       p = softmax(logits) in float32; the top k of p;
 *                                            divided by their sum where `renormalize`
 *   TOPK_SOFTMAX (gpt-oss):                  the top k logits; their softmax in float32
 *   weights rounded to the model's dtype (route's `.to(x.dtype)`), then the experts.
 *
 * The top k come out in torch.topk's order, ties included (cpu_topk.cpp): bfloat16 logits tie
 * often, and which of two equal experts is taken decides the layer's output.
 */
#include <math.h>

#include "cpu_decode_step.h"
#include "cpu_dtypes.h"

/* x[0 .. n) = softmax(x) in float32, as torch's: the maximum subtracted, exp, the sum. */
static void softmax(float *x, int64_t n) {
    float peak = -INFINITY, total = 0.0f;
    for (int64_t i = 0; i < n; i++) peak = x[i] > peak ? x[i] : peak;
    for (int64_t i = 0; i < n; i++) total += (x[i] = expf(x[i] - peak));
    for (int64_t i = 0; i < n; i++) x[i] /= total;
}

/* One token's experts: ids and weights (top_k each) from its logits row (num_experts). */
static void route_row(const void *logits, int64_t r, const MoeShape *moe, int dtype,
                      float *scores, void *work, int64_t *ids, float *weights) {
    int64_t E = moe->num_experts, k = moe->top_k;
    for (int64_t e = 0; e < E; e++) scores[e] = get(logits, r * E + e, dtype);
    if (moe->routing == SOFTMAX_TOPK) {
        softmax(scores, E);
        topk_largest(scores, E, k, work, weights, ids);
        if (moe->renormalize) {
            float total = 0.0f;
            for (int64_t j = 0; j < k; j++) total += weights[j];
            for (int64_t j = 0; j < k; j++) weights[j] /= total;
        }
    } else {
        topk_largest(scores, E, k, work, weights, ids);
        softmax(weights, k);
    }
    for (int64_t j = 0; j < k; j++) weights[j] = held(weights[j], dtype);
}

int decode_moe(const LayerMlp *m, const DecodeShape *s, const Buffers *b, int64_t M) {
    const MoeShape *moe = &s->moe;
    int64_t E = moe->num_experts, k = moe->top_k, H = s->hidden;
    decode_linear(b->h, m->router, NULL, m->router_bias, b->logits, M, E, H, s, b);
    for (int64_t r = 0; r < M; r++)
        route_row(b->logits, r, moe, s->dtype, b->scores, b->topk_work, b->topk_ids + r * k,
                  b->topk_weights + r * k);
    int status = moe_experts(b->h, b->topk_ids, b->topk_weights, m->experts_gate_up,
                             m->experts_down, m->experts_gate_up_bias, m->experts_down_bias,
                             b->y, M, k, E, H, moe->intermediate, s->dtype, (int)moe->pairs,
                             (int)moe->activation, moe->alpha, moe->limit, moe->chunk_bytes,
                             s->threads);
    return status == 0 ? 0 : -1;
}
