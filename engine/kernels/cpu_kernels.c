/* The CPU path's kernels: paged decode attention and KV stores that read and write the
 * block-major cache in place, and the decoder's RMSNorm (with its residual add) and rotary
 * embedding, each one pass over its rows instead of a handful of torch operations.
 *
 * The torch path (torch_paged.py) must gather each sequence's blocks into a padded copy before a
 * batched multiply can read them: on a decode step that copy is as much memory traffic as the
 * attention itself. Here each (sequence, KV head) walks its block table and reads every key and
 * value row once where it lies, for all the query heads that share it (GQA), with a two-pass
 * softmax in float32 (scores, then max / exp / sum, then the weighted sum of values): the
 * reference's maths, summed in another order.
 *
 * Layout (engine/kv_cache.py): cache[block][slot][kv_head][d], blocks `block_stride` elements
 * apart (the other layers of the pool lie between). Element types: float32, or bfloat16 read as
 * the high half of a float32. q and out are float32 (the caller converts).
 *
 * Built by cpu_kernels.py with the host's compiler; no Python or torch headers, so it builds in
 * about a second and is called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dtypes.h"

/* One cached row of head_dim values as float32: the row itself, or converted into buf. The
 * attention loops read float32 rows through this even after a bfloat16 cache is staged: the same
 * loops written with the row pointer inline measured twice as slow (gcc 12, -O3; cause not
 * found), so this form stays. */
static inline const float *load_row(const void *cache, int64_t index, int dtype, int64_t d,
                                    float *buf) {
    if (dtype == F32) return (const float *)cache + index;
    const uint16_t *src = (const uint16_t *)cache + index;
    for (int64_t i = 0; i < d; i++) buf[i] = from_bf16(src[i]);
    return buf;
}

/* exp(x) for the softmax's x <= 0, in float32 to about one unit in the last place (Cephes'
 * expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n put in the exponent bits). Unlike
 * libm's expf it has no call and no branch, so the loop over a row of scores vectorizes; below
 * -87 (e^x < 1.7e-38, nothing next to the row's maximum of e^0) it returns e^-87. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Inlined into one copy per common head size, so that d is a constant there and the loops over
 * it unroll into a few vector instructions (a run-time d makes them several times slower). */
static inline __attribute__((always_inline)) void attend_one(
    const float *restrict q, const void *k_cache, const void *v_cache, int dtype,
    const int32_t *table, int64_t len, float *restrict out, int64_t group, int64_t num_kv_heads,
    int64_t head, const int64_t d, int64_t block_size, int64_t block_stride, float scale,
    int64_t window, float soft_cap, float *restrict scores, float *restrict buf,
    float *restrict staging, int64_t *restrict rows) {
    int64_t start = (window > 0 && len > window) ? len - window : 0;
    int64_t n = len - start;
    /* Where each token's row lies, found once by walking the block table (a division per
     * token, in the loops below, would cost more than the dot products). */
    for (int64_t i = 0, block = start / block_size, slot = start % block_size; i < n; i++) {
        rows[i] = (int64_t)table[block] * block_stride + (slot * num_kv_heads + head) * d;
        if (++slot == block_size) slot = 0, block++;
    }
    if (dtype == BF16) {
        /* Converted once into float32 rows (n keys, then n values) instead of once per query
         * head of the group: the loops below then read float32 either way. */
        float *keys = staging, *values = staging + n * d;
        for (int64_t i = 0; i < n; i++) {
            load_row(k_cache, rows[i], BF16, d, keys + i * d);
            load_row(v_cache, rows[i], BF16, d, values + i * d);
            rows[i] = i * d;
        }
        k_cache = keys, v_cache = values, dtype = F32;
    }
    for (int64_t g = 0; g < group; g++) {
        const float *restrict qg = q + g * d;
        for (int64_t i = 0; i < n; i++) {
            float s = dot(qg, load_row(k_cache, rows[i], dtype, d, buf), d) * scale;
            scores[g * n + i] = soft_cap > 0.0f ? soft_cap * tanhf(s / soft_cap) : s;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * n, peak = -INFINITY, total = 0.0f;
        for (int64_t i = 0; i < n; i++) peak = row[i] > peak ? row[i] : peak;
        for (int64_t i = 0; i < n; i++) total += (row[i] = exp_nonpositive(row[i] - peak));
        for (int64_t i = 0; i < n; i++) row[i] /= total;
    }
    /* A query head at a time, its output row accumulated in registers over the tokens (the
     * values of one KV head are read back from cache by the other query heads of the group). */
    for (int64_t g = 0; g < group; g++) {
        float acc[d];
        for (int64_t j = 0; j < d; j++) acc[j] = 0.0f;
        const float *restrict p = scores + g * n;
        for (int64_t i = 0; i < n; i++) {
            const float *restrict v = load_row(v_cache, rows[i], dtype, d, buf);
            for (int64_t j = 0; j < d; j++) acc[j] += p[i] * v[j];
        }
        for (int64_t j = 0; j < d; j++) out[g * d + j] = acc[j];
    }
}

#define ATTEND_ONE(D)                                                                          \
    attend_one(q, k_cache, v_cache, dtype, table, len, out, group, num_kv_heads, head, D,      \
               block_size, block_stride, scale, window, soft_cap, scores, buf, staging, rows)

static void attend_one_any(const float *q, const void *k_cache, const void *v_cache, int dtype,
                           const int32_t *table, int64_t len, float *out, int64_t group,
                           int64_t num_kv_heads, int64_t head, int64_t d, int64_t block_size,
                           int64_t block_stride, float scale, int64_t window, float soft_cap,
                           float *scores, float *buf, float *staging, int64_t *rows) {
    switch (d) {
        case 64: ATTEND_ONE(64); break;
        case 128: ATTEND_ONE(128); break;
        default: ATTEND_ONE(d);
    }
}

/* q, out: (batch, num_heads, d) float32; block_tables: (batch, max_blocks) int32;
 * context_lens: (batch,) int32, counting the new token. window <= 0: none; soft_cap <= 0: none.
 * Returns 0, or -1 when scratch memory could not be had. */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                 const int32_t *block_tables, const int32_t *context_lens, float *out,
                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                 int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale,
                 int64_t window, float soft_cap, int threads) {
    int64_t group = num_heads / num_kv_heads, longest = 0;
    for (int64_t b = 0; b < batch; b++)
        longest = context_lens[b] > longest ? context_lens[b] : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* per thread: the scores, a row converted to float32, the rows of a bfloat16 cache
         * converted, then (8-byte aligned) the rows' offsets */
        int64_t staged = dtype == F32 ? 0 : 2 * longest * d;
        int64_t num_floats = (group * longest + d + staged + 1) & ~(int64_t)1;
        float *scores = malloc(sizeof(float) * num_floats + sizeof(int64_t) * longest);
        if (scores == NULL) {
            failed = 1;
        } else {
#pragma omp for collapse(2) schedule(dynamic)
            for (int64_t b = 0; b < batch; b++) {
                for (int64_t h = 0; h < num_kv_heads; h++) {
                    int64_t first = (b * num_heads + h * group) * d;
                    attend_one_any(q + first, k_cache, v_cache, dtype,
                                   block_tables + b * max_blocks, context_lens[b], out + first,
                                   group, num_kv_heads, h, d, block_size, block_stride, scale,
                                   window, soft_cap, scores, scores + group * longest,
                                   scores + group * longest + d,
                                   (int64_t *)(scores + num_floats));
                }
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}

/* Write k, v: (num_tokens, row_len) at slot_mapping (block * block_size + offset); negative
 * slots (padding) are skipped. row_len = num_kv_heads * d; elem_size: 4 or 2 bytes. */
void store_kv(const void *k, const void *v, void *k_cache, void *v_cache,
              const int64_t *slot_mapping, int64_t num_tokens, int64_t row_len,
              int64_t elem_size, int64_t block_size, int64_t block_stride) {
    int64_t row_bytes = row_len * elem_size;
    for (int64_t i = 0; i < num_tokens; i++) {
        int64_t slot = slot_mapping[i];
        if (slot < 0) continue;
        int64_t at = ((slot / block_size) * block_stride + (slot % block_size) * row_len) *
                     elem_size;
        memcpy((char *)k_cache + at, (const char *)k + i * row_bytes, row_bytes);
        memcpy((char *)v_cache + at, (const char *)v + i * row_bytes, row_bytes);
    }
}

/* Llama's RMSNorm over rows of x: (rows, dim), written to out, in the order Hugging Face computes
 * it (in float32: x * rsqrt(mean(x^2) + eps), rounded to the dtype, times the weight). With a
 * residual, the row normalised is residual + x, which is stored back into residual first (the
 * decoder's skip connection, one pass instead of an add and a norm). */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t dim, float eps, int dtype) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t at = r * dim;
        float sum = 0.0f;
        for (int64_t j = 0; j < dim; j++) {
            float v = get(x, at + j, dtype);
            if (residual != NULL) {
                v = held(get(residual, at + j, dtype) + v, dtype);
                put(residual, at + j, v, dtype);
            }
            sum += v * v;
        }
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        const void *normed = residual != NULL ? residual : x;
        for (int64_t j = 0; j < dim; j++) {
            float v = held(get(normed, at + j, dtype) * inv, dtype);
            put(out, at + j, get(weight, j, dtype) * v, dtype);
        }
    }
}

/* Rotary embedding in place (rotate-half form) on x: (tokens, heads, d) with rows token_stride
 * elements apart and each head's d values contiguous; cos, sin: (positions, d) float32 tables.
 * Computed in float32, as the reference does, and rounded once to the dtype. */
void rope(void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
          const int64_t *positions, const float *cos, const float *sin, int dtype) {
    int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * d, *s = sin + positions[t] * d;
        for (int64_t h = 0; h < heads; h++) {
            int64_t at = t * token_stride + h * d;
            for (int64_t j = 0; j < half; j++) {
                float x1 = get(x, at + j, dtype), x2 = get(x, at + j + half, dtype);
                put(x, at + j, x1 * c[j] - x2 * s[j], dtype);
                put(x, at + j + half, x2 * c[j + half] + x1 * s[j + half], dtype);
            }
        }
    }
}
