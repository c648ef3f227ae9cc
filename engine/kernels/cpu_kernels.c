/* The CPU path's kernels: paged attention and KV stores that read and write the block-major
 * cache in place, and the decoder's RMSNorm (with its residual add), rotary embedding and MLP
 * activation, each one pass over its rows instead of a handful of torch operations.
 *
 * The torch path (torch_paged.py) must gather each sequence's blocks into a padded copy before a
 * batched multiply can read them: on a decode step that copy is as much memory traffic as the
 * attention itself. Here each sequence walks its block table and reads every key and value row
 * once where it lies, eight tokens at a time for all its query heads (GQA: a KV head's rows
 * serve every query head that shares it), with a two-pass softmax in float32 (scores, then
 * max / exp / sum, then the weighted sum of values): the reference's maths, summed in another
 * order. Prefill takes a sequence's new tokens a tile at a time (paged_prefill, below); with
 * a sliding window or a soft cap, each new token as a decode query over its own prefix.
 *
 * On SmolLM2, 32 sequences of 250 tokens, 30 layers, one thread (session 15's AVX-512 host):
 * 35 ms in float32 and 23 in bfloat16, where a pass per (sequence, KV head) with a horizontal sum
 * per key took 45 and 45. The float32 time is the cache's bytes: a block of one layer is 12 KB
 * (the layers lie between), and a core read such scattered 12 KB pieces at ~11 GB/s where it
 * streams 25; prefetching two chunks ahead into L2 is what moved it.
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

/* call(args..., dtype) with dtype a constant, F32 or BF16: the always-inline bodies below then
 * get one copy per dtype, whose loops vectorize (a run-time dtype keeps them scalar). */
#define WITH_DTYPE(dtype, call, ...) \
    ((dtype) == F32 ? call(__VA_ARGS__, F32) : call(__VA_ARGS__, BF16))

/* The longest of the batch's context lengths: what each thread's scratch is sized for. */
static int64_t longest_context(const int32_t *context_lens, int64_t batch) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++)
        longest = context_lens[b] > longest ? context_lens[b] : longest;
    return longest;
}

/* exp(x) in float32 to about one unit in the last place (Cephes' expf: x = n ln2 + r, a
 * degree-6 polynomial for e^r, 2^n put in the exponent bits). Unlike libm's expf it has no call
 * and no branch, so loops over rows of values vectorize. x is clamped to [-87, 88]: e^-87 is
 * 1.6e-38 (nothing next to a softmax row's maximum of e^0, or to SiLU's 1 + e^x), e^88 is
 * 1.7e38 (where libm would give infinity, SiLU's x / (1 + e^-x) is 0 either way). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
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

/* Lanes of a and b (b's numbered from 8) picked by constant indices: GCC's builtin, or clang's. */
#ifdef __clang__
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Lane j of the result: the sum of the lanes of v[j]. Three rounds of pairing halves, so eight
 * dot products finish together in 21 vector operations instead of eight horizontal sums. */
static inline __attribute__((always_inline)) v8f sum_lanes8(const v8f v[8]) {
    v8f t[4], u[2];
    for (int i = 0; i < 4; i++) /* [key 2i: 4 partial sums | key 2i+1: 4] */
        t[i] = SHUFFLE8(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               SHUFFLE8(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* [4 keys: 2 partial sums each] */
        u[i] = SHUFFLE8(t[2 * i], t[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               SHUFFLE8(t[2 * i], t[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUFFLE8(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           SHUFFLE8(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

enum { KEYS = 8 };  /* keys scored at once: one sum_lanes8 */
enum { AHEAD = 2 }; /* chunks of keys prefetched ahead: a block's first rows miss otherwise */

/* Ask for the rows (every KV head of a token: row_len values) of the chunk starting at token
 * `from`, where it exists. */
static inline void prefetch_chunk(const void *cache, const int64_t *rows, int64_t from,
                                  int64_t n, int64_t row_len, int dtype) {
    int64_t elem = dtype == F32 ? 4 : 2;
    for (int64_t j = from; j < n && j < from + KEYS; j++)
        for (int64_t b = 0; b < row_len * elem; b += 64)
            __builtin_prefetch((const char *)cache + rows[j] * elem + b, 0, 1);
}

/* Query heads of one KV head worked on together, its keys and values loaded (and widened from
 * bfloat16) once for all of them: 3 x 8 partial sums, or 3 x 8 accumulators of 64 columns, with
 * their operands fill AVX-512's 32 vector registers. */
enum { HEADS_AT_ONCE = 3 };

/* The scores of the KEYS tokens at `rows` for heads h0 .. h0 + hb - 1, which share the KV head
 * whose values start `at` elements into a token's row: into scores[h][0 .. KEYS). */
static inline __attribute__((always_inline)) void score_chunk(
    const float *restrict q, const void *k_cache, const int dtype, const int64_t *rows,
    int64_t at, int64_t h0, const int hb, const int64_t d, float scale, float *restrict scores,
    int64_t stride) {
    v8f part[HEADS_AT_ONCE][KEYS];
    for (int g = 0; g < hb; g++)
        for (int j = 0; j < KEYS; j++) part[g][j] = splat(0.0f);
    for (int64_t c = 0; c < d; c += 8) {
        v8f qc[HEADS_AT_ONCE];
        for (int g = 0; g < hb; g++) qc[g] = load8(q, (h0 + g) * d + c, F32);
        for (int j = 0; j < KEYS; j++) {
            v8f k = load8(k_cache, rows[j] + at + c, dtype);
            for (int g = 0; g < hb; g++) part[g][j] += qc[g] * k;
        }
    }
    for (int g = 0; g < hb; g++) {
        v8f s = sum_lanes8(part[g]) * splat(scale);
        memcpy(scores + (h0 + g) * stride, &s, sizeof s);
    }
}

/* out[h] += sum over the m tokens at `rows` of p[h][j] * v[j], for heads h0 .. h0 + hb - 1 (as
 * score_chunk), 64 columns at a time: each value row is loaded once for the hb heads. */
static inline __attribute__((always_inline)) void weigh_chunk(
    const float *restrict p, int64_t stride, const void *v_cache, const int dtype,
    const int64_t *rows, int64_t m, int64_t at, int64_t h0, const int hb, const int64_t d,
    float *restrict out) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const int64_t width = d - c0 < 64 ? d - c0 : 64;
        v8f acc[HEADS_AT_ONCE][8];
        for (int g = 0; g < hb; g++)
            for (int64_t c = 0; c < width; c += 8)
                acc[g][c / 8] = load8(out, (h0 + g) * d + c0 + c, F32);
        for (int64_t j = 0; j < m; j++) {
            v8f pj[HEADS_AT_ONCE];
            for (int g = 0; g < hb; g++) pj[g] = splat(p[(h0 + g) * stride + j]);
            for (int64_t c = 0; c < width; c += 8) {
                v8f v = load8(v_cache, rows[j] + at + c0 + c, dtype);
                for (int g = 0; g < hb; g++) acc[g][c / 8] += pj[g] * v;
            }
        }
        for (int g = 0; g < hb; g++)
            for (int64_t c = 0; c < width; c += 8)
                memcpy(out + (h0 + g) * d + c0 + c, &acc[g][c / 8], sizeof(v8f));
    }
}

/* Calls CALL(hb) with hb = the heads left, up to HEADS_AT_ONCE, as a constant. */
#define FOR_HEADS_AT_ONCE(left, CALL)                                                          \
    switch ((left) < HEADS_AT_ONCE ? (left) : HEADS_AT_ONCE) {                                 \
        case 1: CALL(1); break;                                                                \
        case 2: CALL(2); break;                                                                \
        default: CALL(3); break;                                                               \
    }

/* One sequence, every head: q, out (num_heads, d). Its tokens are taken KEYS at a time, and
 * all heads work on a chunk while its rows (every KV head of a token lies together) are in L1:
 * the cache streams through once, in order within each block. scores: num_heads rows of
 * `stride` floats (n rounded up to KEYS); rows: `stride` int64. Inlined into one copy per
 * common head size, so that d is a constant there and the loops over it unroll. */
static inline __attribute__((always_inline)) void attend_sequence(
    const float *restrict q, const void *k_cache, const void *v_cache, const int dtype,
    const int32_t *table, int64_t len, float *restrict out, int64_t num_heads,
    int64_t num_kv_heads, const int64_t d, int64_t block_size, int64_t block_stride,
    float scale, int64_t window, float soft_cap, float *restrict scores,
    int64_t *restrict rows) {
    int64_t start = (window > 0 && len > window) ? len - window : 0;
    int64_t n = len - start, stride = (n + KEYS - 1) / KEYS * KEYS;
    int64_t group = num_heads / num_kv_heads;
    /* Where each token's row lies, found once by walking the block table; a partial last chunk
     * reads the first token again (its lanes are never used) instead of branching. */
    for (int64_t i = 0, block = start / block_size, slot = start % block_size; i < n; i++) {
        rows[i] = (int64_t)table[block] * block_stride + slot * num_kv_heads * d;
        if (++slot == block_size) slot = 0, block++;
    }
    for (int64_t i = n; i < stride; i++) rows[i] = rows[0];
    for (int64_t i0 = 0; i0 < n; i0 += KEYS) {
        prefetch_chunk(k_cache, rows, i0 + AHEAD * KEYS, n, num_kv_heads * d, dtype);
        for (int64_t h = 0; h < num_heads;) {
            int64_t at = (h / group) * d, left = (h / group + 1) * group - h;
#define SCORE(hb)                                                                              \
    score_chunk(q, k_cache, dtype, rows + i0, at, h, hb, d, scale, scores + i0, stride);       \
    h += hb
            FOR_HEADS_AT_ONCE(left, SCORE)
#undef SCORE
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *row = scores + h * stride, peak = -INFINITY, total = 0.0f;
        if (soft_cap > 0.0f)
            for (int64_t i = 0; i < n; i++) row[i] = soft_cap * tanhf(row[i] / soft_cap);
        for (int64_t i = 0; i < n; i++) peak = row[i] > peak ? row[i] : peak;
        for (int64_t i = 0; i < n; i++) total += (row[i] = exp_clamped(row[i] - peak));
        for (int64_t i = 0; i < n; i++) row[i] /= total;
    }
    /* Each output row is accumulated over the tokens in order, as the reference sums them. */
    for (int64_t i = 0; i < num_heads * d; i++) out[i] = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += KEYS) {
        prefetch_chunk(v_cache, rows, i0 + AHEAD * KEYS, n, num_kv_heads * d, dtype);
        int64_t m = n - i0 < KEYS ? n - i0 : KEYS;
        for (int64_t h = 0; h < num_heads;) {
            int64_t at = (h / group) * d, left = (h / group + 1) * group - h;
#define WEIGH(hb)                                                                              \
    weigh_chunk(scores + i0, stride, v_cache, dtype, rows + i0, m, at, h, hb, d, out);         \
    h += hb
            FOR_HEADS_AT_ONCE(left, WEIGH)
#undef WEIGH
        }
    }
}

#define ATTEND(D, DTYPE)                                                                       \
    attend_sequence(q, k_cache, v_cache, DTYPE, table, len, out, num_heads, num_kv_heads, D,   \
                    block_size, block_stride, scale, window, soft_cap, scores, rows)

static void attend_sequence_any(const float *q, const void *k_cache, const void *v_cache,
                                int dtype, const int32_t *table, int64_t len, float *out,
                                int64_t num_heads, int64_t num_kv_heads, int64_t d,
                                int64_t block_size, int64_t block_stride, float scale,
                                int64_t window, float soft_cap, float *scores, int64_t *rows) {
    if (dtype == F32) {
        switch (d) {
            case 64: ATTEND(64, F32); break;
            case 128: ATTEND(128, F32); break;
            default: ATTEND(d, F32);
        }
    } else {
        switch (d) {
            case 64: ATTEND(64, BF16); break;
            case 128: ATTEND(128, BF16); break;
            default: ATTEND(d, BF16);
        }
    }
}

/* q, out: (batch, num_heads, d) float32, d a multiple of 8; block_tables: (batch, max_blocks)
 * int32; context_lens: (batch,) int32, counting the new token. window <= 0: none;
 * soft_cap <= 0: none. Returns 0, or -1 when scratch memory could not be had. */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                 const int32_t *block_tables, const int32_t *context_lens, float *out,
                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                 int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale,
                 int64_t window, float soft_cap, int threads) {
    if (d % 8 != 0) abort(); /* cpu_kernels.supports() sends such caches to the torch path */
    int64_t longest = longest_context(context_lens, batch);
    int64_t stride = (longest + KEYS - 1) / KEYS * KEYS;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* per thread: every head's scores, then the rows' offsets */
        float *scores = malloc(sizeof(float) * num_heads * stride + sizeof(int64_t) * stride);
        if (scores == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t b = 0; b < batch; b++)
                attend_sequence_any(q + b * num_heads * d, k_cache, v_cache, dtype,
                                    block_tables + b * max_blocks, context_lens[b],
                                    out + b * num_heads * d, num_heads, num_kv_heads, d,
                                    block_size, block_stride, scale, window, soft_cap, scores,
                                    (int64_t *)(scores + num_heads * stride));
            free(scores);
        }
    }
    return failed ? -1 : 0;
}

/* Prefill: a sequence's new tokens attend causally over its cache, the scores and the weighted
 * sums as small matrix products. For one KV head, its keys are gathered transposed (d x n,
 * float32) and its values as rows (n x d); TILE rows of (query token, query head) pairs then
 * take 16 keys at a time (two vectors of scores a row: TILE x 2 accumulators, each key element
 * loaded once for the whole tile), and 16 output columns at a time over the values. A row's keys
 * end at its own position: key blocks past the tile's last position are skipped, and within the
 * rest a row's later keys get probability 0. SmolLM2, 8 prompts of 191 tokens, 30 layers: 0.17 s
 * in float32 or bfloat16, against 0.25 for a decode query per token (which reloads the keys for
 * every query) and 0.42 for the torch path. No window or soft cap here (the caller takes the
 * decode path for those). */
#ifdef __AVX512VL__
enum { TILE = 12 }; /* 24 accumulators in AVX-512's 32 registers */
#else
enum { TILE = 6 };
#endif

/* scratch: padded * (2 * d + TILE) floats, padded = total rounded up to 16. */
static inline __attribute__((always_inline)) void prefill_sequence(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
    int64_t total, int64_t queries, float *out, int64_t num_heads, int64_t num_kv_heads,
    int64_t d, int64_t block_size, int64_t block_stride, float scale, float *scratch,
    const int dtype) {
    int64_t group = num_heads / num_kv_heads, padded = (total + 15) / 16 * 16;
    int64_t first_pos = total - queries, num_rows = queries * group;
    float *keys_t = scratch, *values = scratch + padded * d, *probs = scratch + 2 * padded * d;
    for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
        for (int64_t i = 0; i < padded; i++) {
            int64_t row = (int64_t)table[i < total ? i / block_size : 0] * block_stride +
                          ((i % block_size) * num_kv_heads + kvh) * d;
            for (int64_t c = 0; c < d; c += 8) {
                v8f k = i < total ? load8(k_cache, row + c, dtype) : splat(0.0f);
                v8f v = i < total ? load8(v_cache, row + c, dtype) : splat(0.0f);
                memcpy(values + i * d + c, &v, sizeof v);
                for (int u = 0; u < 8; u++) keys_t[(c + u) * padded + i] = k[u];
            }
        }
        for (int64_t r0 = 0; r0 < num_rows; r0 += TILE) {
            /* rows r0 .. r0 + TILE - 1 are (token r / group, head kvh * group + r % group); past
             * the last row the tile repeats it (computed, never stored) */
            const float *qrow[TILE];
            int64_t at[TILE], limit[TILE], keys = 0;
            for (int t = 0; t < TILE; t++) {
                int64_t r = r0 + t < num_rows ? r0 + t : num_rows - 1;
                at[t] = ((r / group) * num_heads + kvh * group + r % group) * d;
                qrow[t] = q + at[t];
                limit[t] = first_pos + r / group + 1;
                keys = limit[t] > keys ? limit[t] : keys;
            }
            for (int64_t k0 = 0; k0 < keys; k0 += 16) {
                v8f acc[TILE][2];
                for (int t = 0; t < TILE; t++) acc[t][0] = acc[t][1] = splat(0.0f);
                for (int64_t c = 0; c < d; c++) {
                    v8f lo = load8(keys_t, c * padded + k0, F32);
                    v8f hi = load8(keys_t, c * padded + k0 + 8, F32);
                    for (int t = 0; t < TILE; t++) {
                        v8f qc = splat(qrow[t][c]);
                        acc[t][0] += qc * lo;
                        acc[t][1] += qc * hi;
                    }
                }
                for (int t = 0; t < TILE; t++) {
                    v8f lo = acc[t][0] * splat(scale), hi = acc[t][1] * splat(scale);
                    memcpy(probs + t * padded + k0, &lo, sizeof lo);
                    memcpy(probs + t * padded + k0 + 8, &hi, sizeof hi);
                }
            }
            int64_t blocks_end = (keys + 15) / 16 * 16;
            for (int t = 0; t < TILE; t++) {
                float *row = probs + t * padded, peak = -INFINITY, sum = 0.0f;
                for (int64_t i = 0; i < limit[t]; i++) peak = row[i] > peak ? row[i] : peak;
                for (int64_t i = 0; i < limit[t]; i++) sum += (row[i] = exp_clamped(row[i] - peak));
                for (int64_t i = 0; i < limit[t]; i++) row[i] /= sum;
                for (int64_t i = limit[t]; i < blocks_end; i++) row[i] = 0.0f;
            }
            for (int64_t c0 = 0; c0 < d; c0 += 16) {
                v8f acc[TILE][2];
                for (int t = 0; t < TILE; t++) acc[t][0] = acc[t][1] = splat(0.0f);
                for (int64_t i = 0; i < keys; i++) {
                    v8f lo = load8(values, i * d + c0, F32);
                    v8f hi = c0 + 8 < d ? load8(values, i * d + c0 + 8, F32) : splat(0.0f);
                    for (int t = 0; t < TILE; t++) {
                        v8f p = splat(probs[t * padded + i]);
                        acc[t][0] += p * lo;
                        acc[t][1] += p * hi;
                    }
                }
                for (int t = 0; t < TILE && r0 + t < num_rows; t++) {
                    float *o = out + at[t] + c0;
                    memcpy(o, &acc[t][0], sizeof(v8f));
                    if (c0 + 8 < d) memcpy(o + 8, &acc[t][1], sizeof(v8f));
                }
            }
        }
    }
}

/* q, out: (num_tokens, num_heads, d) float32, d a multiple of 8, the sequences' new tokens back
 * to back (cu_seqlens_q: (batch + 1,) int32); context_lens: (batch,) int32, each sequence's
 * cached prefix plus its new tokens. Returns 0, or -1 when scratch memory could not be had. */
int paged_prefill(const float *q, const void *k_cache, const void *v_cache, int dtype,
                  const int32_t *block_tables, const int32_t *cu_seqlens_q,
                  const int32_t *context_lens, float *out, int64_t batch, int64_t num_heads,
                  int64_t num_kv_heads, int64_t d, int64_t block_size, int64_t block_stride,
                  int64_t max_blocks, float scale, int threads) {
    if (d % 8 != 0) abort(); /* cpu_kernels.supports() sends such caches to the torch path */
    int64_t padded = (longest_context(context_lens, batch) + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * padded * (2 * d + TILE));
        if (scratch == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t b = 0; b < batch; b++) {
                int64_t start = cu_seqlens_q[b], queries = cu_seqlens_q[b + 1] - start;
                if (queries == 0) continue;
                WITH_DTYPE(dtype, prefill_sequence, q + start * num_heads * d, k_cache, v_cache,
                           block_tables + b * max_blocks, context_lens[b], queries,
                           out + start * num_heads * d, num_heads, num_kv_heads, d, block_size,
                           block_stride, scale, scratch);
            }
            free(scratch);
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
static inline __attribute__((always_inline)) void rms_norm_rows(
    const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
    float eps, const int dtype) {
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

void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t dim, float eps, int dtype) {
    WITH_DTYPE(dtype, rms_norm_rows, x, residual, weight, out, rows, dim, eps);
}

/* Rotary embedding in place (rotate-half form) on x: (tokens, heads, d) with rows token_stride
 * elements apart and each head's d values contiguous; cos, sin: (positions, d) float32 tables.
 * Computed in float32, as the reference does, and rounded once to the dtype. */
static inline __attribute__((always_inline)) void rope_rows(
    void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
    const int64_t *positions, const float *cos, const float *sin, const int dtype) {
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

void rope(void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
          const int64_t *positions, const float *cos, const float *sin, int dtype) {
    WITH_DTYPE(dtype, rope_rows, x, token_stride, tokens, heads, d, positions, cos, sin);
}

/* The MLP's activation: silu(gate) * up over rows of gate_up (rows, 2 * inter), the gate's
 * inter values then the up's, into out (rows, inter); each op rounded to the dtype as torch's
 * silu and product are. exp_clamped for torch's vectorised exp: both within about one unit in
 * the last place of float32. */
static inline __attribute__((always_inline)) void silu_mul_rows(const void *gate_up, void *out,
                                                                int64_t rows, int64_t inter,
                                                                const int dtype) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t gate = r * 2 * inter, up = gate + inter;
        for (int64_t j = 0; j < inter; j++) {
            float g = get(gate_up, gate + j, dtype);
            float silu = g / (1.0f + exp_clamped(-g));
            silu = held(g == -INFINITY ? NAN : silu, dtype); /* torch: -inf / inf */
            put(out, r * inter + j, silu * get(gate_up, up + j, dtype), dtype);
        }
    }
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype) {
    WITH_DTYPE(dtype, silu_mul_rows, gate_up, out, rows, inter);
}
