/* Batched LoRA on the CPU: for every token t whose adapter slot s = slots[t] is not -1,
 *
 *     y[t] += scales[s] * B[s] @ (A[s] @ x[t])
 *
 * with each adapter's matrices stacked by slot (engine/lora/manager.py):
 *
 *     a (num_slots, R, K)   the shrink: R = slices * max_rank rows, a fused layer's slices' A
 *                           side by side, unused rows zero
 *     b (num_slots, N, R)   the expand: slice i's outputs read only its A's rows (block
 *                           diagonal), so one product covers q, k and v (or gate and up)
 *
 * One call serves a whole mixed batch (punica's "SGMV" idea, without the segment sort): tokens
 * go to threads, each token reads its own slot's A and B (a few hundred KiB at rank 16 on
 * SmolLM2, kept in L2 while a prefill chunk of one adapter runs through them). Everything is
 * float32; the caller widens x and y.
 */
#include <stdint.h>

static float dot(const float *restrict u, const float *restrict v, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += u[i] * v[i];
    return acc;
}

void lora_add(const float *x, float *y, const float *a, const float *b, const float *scales,
              const int32_t *slots, int64_t num_tokens, int64_t k, int64_t n, int64_t r,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        int32_t s = slots[t];
        if (s < 0) continue;
        float h[r];
        const float *as = a + (int64_t)s * r * k, *bs = b + (int64_t)s * n * r;
        for (int64_t i = 0; i < r; i++) h[i] = scales[s] * dot(as + i * k, x + t * k, k);
        float *yt = y + t * n;
        for (int64_t o = 0; o < n; o++) yt[o] += dot(bs + o * r, h, r);
    }
}
