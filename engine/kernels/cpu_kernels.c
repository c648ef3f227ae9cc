/* The CPU path's kernels: paged attention and KV stores that read and write the block-major
 * cache in place, and the decoder's RMSNorms (Llama's and Gemma's, with the residual add, or
 * per head for q/k norms), rotary embedding (full or partial) and MLP activations (SiLU, GELU),
 * each one pass over its rows instead of a handful of torch operations.
 *
 * The torch path (torch_paged.py) must gather each sequence's blocks into a padded copy before a
 * batched multiply can read them: on a decode step that copy is as much memory traffic as the
 * attention itself. Here each sequence walks its block table and reads every key and value row
 * once where it lies, eight tokens at a time for all its query heads (GQA: a KV head's rows
 * serve every query head that shares it), with a two-pass softmax in float32 (scores, then
 * max / exp / sum, then the weighted sum of values): the reference's maths, summed in another
 * order. Prefill takes a sequence's new tokens a tile at a time (paged_prefill, below; a
 * bfloat16 model's over a bfloat16 cache by AVX512-BF16 dot products, cpu_prefill_pairs.c). Both
 * take a sliding window (keys before it are skipped), a soft cap (tanh_clamped, vectorized) and
 * attention sinks (gpt-oss: a logit per query head that joins each row's softmax, with no
 * value, so the row's weights sum to less than one).
 *
 * On SmolLM2, 32 sequences of 250 tokens, 30 layers, one thread (session 15's AVX-512 host):
 * 35 ms in float32 and 23 in bfloat16, where a pass per (sequence, KV head) with a horizontal sum
 * per key took 45 and 45. The float32 time is the cache's bytes: a block of one layer is 12 KB
 * (the layers lie between), and a core read such scattered 12 KB pieces at ~11 GB/s where it
 * streams 25; prefetching two chunks ahead into L2 is what moved it. An int8 cache (68-byte rows)
 * reads a quarter of float32's bytes: the same 32 x 250 x 30 layers took 37 ms against 85 in
 * float32 and 58 in bfloat16, interleaved in one run on the shared 2-core AMD dev VM (2026-12-05).
 * On AVX-512 hosts the float32 and bfloat16 caches take a 512-bit path (WIDE_ATTENTION, below):
 * 1.1-1.6x faster than the 8-lane one on one sequence of 512-4k tokens in the four bench models'
 * shapes (bench/decode_attention.py, which says what still bounds it).
 *
 * Layout (engine/kv_cache.py): cache[block][slot][kv_head][row], blocks `block_stride` elements
 * apart (the other layers of the pool lie between). Element types: float32, or bfloat16 read as
 * the high half of a float32, or int8 rows (I8, kernels/kv_quant.py): d int8 values and their
 * float32 scale, d + 4 bytes, the scale taken out of the sums (a key's score is its scale times
 * q . k_int8, a value's weight p_j times its scale). q and out are float32 (the caller
 * converts).
 *
 * Built by cpu_kernels.py with the host's compiler; no Python or torch headers, so it builds in
 * about a second and is called through ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_dtypes.h"

/* call(args..., dtype) with dtype a constant, F32 or BF16: the always-inline bodies below then
 * get one copy per dtype, whose loops vectorize (a run-time dtype keeps them scalar). */
#define WITH_DTYPE(dtype, call, ...) \
    ((dtype) == F32 ? call(__VA_ARGS__, F32) : call(__VA_ARGS__, BF16))

/* The KV cache's third element type: int8 rows of d values and a float32 scale (kv_quant.py). */
enum { I8 = 2 };

/* Elements (bytes for I8) from one cache row to the next, and the bytes of an element. */
static inline int64_t row_pitch(int64_t d, int dtype) { return dtype == I8 ? d + 4 : d; }
static inline int64_t kv_elem_bytes(int dtype) { return dtype == F32 ? 4 : dtype == BF16 ? 2 : 1; }

typedef int8_t v8i8 __attribute__((vector_size(8)));

/* Eight values of a cache row from element `at`, as float32; for I8 before the row's scale.
 * GCC scalarizes __builtin_convertvector from eight int8 (a lane-by-lane conversion, which made
 * the int8 decode slower than float32's): AVX2's sign extension and conversion do it in two. */
static inline __attribute__((always_inline)) v8f load_kv8(const void *p, int64_t at,
                                                          const int dtype) {
    if (dtype != I8) return load8(p, at, dtype);
#ifdef __AVX2__
    __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)p + at));
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
    v8i8 b;
    memcpy(&b, (const int8_t *)p + at, sizeof b);
    return __builtin_convertvector(b, v8f);
#endif
}

/* The scale of the I8 row starting at byte `row` (1 for the other types: no scale). */
static inline float row_scale(const void *p, int64_t row, int64_t d, const int dtype) {
    if (dtype != I8) return 1.0f;
    float scale;
    memcpy(&scale, (const char *)p + row + d, sizeof scale);
    return scale;
}

/* call(args..., dtype) for the cache's three types, each a constant (WITH_DTYPE's reason). */
#define WITH_KV_DTYPE(dtype, call, ...)                                                        \
    ((dtype) == F32 ? call(__VA_ARGS__, F32)                                                   \
                    : (dtype) == BF16 ? call(__VA_ARGS__, BF16) : call(__VA_ARGS__, I8))

/* The longest of the batch's context lengths: what each thread's scratch is sized for. */
static int64_t longest_context(const int32_t *context_lens, int64_t batch) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++)
        longest = context_lens[b] > longest ? context_lens[b] : longest;
    return longest;
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
    int64_t elem = kv_elem_bytes(dtype);
    for (int64_t j = from; j < n && j < from + KEYS; j++)
        for (int64_t b = 0; b < row_len * elem; b += 64)
            __builtin_prefetch((const char *)cache + rows[j] * elem + b, 0, 1);
}

/* Softmax over row[lo .. hi) in place: the soft cap first (soft_cap > 0: cap * tanh(s / cap)),
 * and the sink's logit (NULL: none) in the maximum and the sum, as one more key whose
 * probability is dropped (reference.attend). */
static inline void softmax_row(float *restrict row, int64_t lo, int64_t hi, float soft_cap,
                               const float *sink) {
    float peak = sink != NULL ? *sink : -INFINITY, total = 0.0f;
    if (soft_cap > 0.0f)
        for (int64_t i = lo; i < hi; i++) row[i] = soft_cap * tanh_clamped(row[i] / soft_cap);
#ifdef __AVX512F__
    /* 16 lanes, the tail masked; the sum in 16 partial sums. The scalar loops below cost
     * heads of 64 dearly, where a score is few multiply-adds: over a 1k context, Llama-3.2-1B's
     * step's attention 4.42 -> 3.81 ms, Qwen2.5-0.5B's 2.33 -> 2.19 (bench/decode_attention.py) */
    __m512 peaks = _mm512_set1_ps(peak), sums = _mm512_setzero_ps();
    for (int64_t i = lo; i < hi; i += 16)
        peaks = _mm512_max_ps(peaks, _mm512_mask_loadu_ps(peaks, lanes_below(i, hi), row + i));
    __m512 peak16 = _mm512_set1_ps(peak = _mm512_reduce_max_ps(peaks));
    for (int64_t i = lo; i < hi; i += 16) {
        __mmask16 m = lanes_below(i, hi);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), peak16));
        _mm512_mask_storeu_ps(row + i, m, e);
        sums = _mm512_mask_add_ps(sums, m, sums, e);
    }
    total = _mm512_reduce_add_ps(sums);
    if (sink != NULL) total += exp_clamped(*sink - peak);
    __m512 total16 = _mm512_set1_ps(total);
    for (int64_t i = lo; i < hi; i += 16) {
        __mmask16 m = lanes_below(i, hi);
        _mm512_mask_storeu_ps(row + i, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, row + i), total16));
    }
#else
    int64_t i = lo;
#ifdef __AVX2__
    /* eight running maxima: the scalar loop is one chain of vmaxss, 4 cycles a score (a fifth
     * of SmolLM2's decode attention over a 2k context held in L2) */
    __m256 peaks = _mm256_set1_ps(peak);
    for (; i + 8 <= hi; i += 8) peaks = _mm256_max_ps(peaks, _mm256_loadu_ps(row + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, peaks);
    for (int l = 0; l < 8; l++) peak = lanes[l] > peak ? lanes[l] : peak;
#endif
    for (; i < hi; i++) peak = row[i] > peak ? row[i] : peak;
    for (int64_t i = lo; i < hi; i++) total += (row[i] = exp_clamped(row[i] - peak));
    if (sink != NULL) total += exp_clamped(*sink - peak);
    for (int64_t i = lo; i < hi; i++) row[i] /= total;
#endif
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
            v8f k = load_kv8(k_cache, rows[j] + at + c, dtype);
            for (int g = 0; g < hb; g++) part[g][j] += qc[g] * k;
        }
    }
    v8f scales = splat(scale);
    if (dtype == I8)
        for (int j = 0; j < KEYS; j++) scales[j] *= row_scale(k_cache, rows[j] + at, d, I8);
    for (int g = 0; g < hb; g++) {
        v8f s = sum_lanes8(part[g]) * scales;
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
            float v_scale = row_scale(v_cache, rows[j] + at, d, dtype);
            for (int g = 0; g < hb; g++) pj[g] = splat(p[(h0 + g) * stride + j] * v_scale);
            for (int64_t c = 0; c < width; c += 8) {
                v8f v = load_kv8(v_cache, rows[j] + at + c0 + c, dtype);
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

/* The 512-bit path (AVX-512 hosts; float32 and bfloat16 caches, d a multiple of 32): the same
 * chunks and sums on 16 float32 lanes. The 8-lane path above is bound by its instructions, not
 * by memory, on such a host: widening each bfloat16 (two instructions for 8 values), 8-lane
 * FMAs and the lane sums ran SmolLM2's shape at 13 GB/s with the cache in L2. Here a bfloat16
 * row is widened 32 values at a time by one vpunpcklwd and one vpunpckhwd against zero, which
 * leave the values in an order of their own (wide_element): q is put into that order once a
 * sequence (a dot product does not care), and the output accumulated in it and put back at the
 * end. The products and sums are float32 as on the 8-lane path, in another order. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define WIDE_ATTENTION 1

/* The element of a 32-value unit that load32 puts in lane l (0..15: its first vector's lanes,
 * 16..31: its second's): the float32 rows' own order; for bfloat16, vpunpck{l,h}wd take each
 * 128-bit lane's low and high four values. */
static inline int64_t wide_element(int64_t l, int dtype) {
    if (dtype == F32) return l;
    int64_t lane = l % 16;
    return 8 * (lane / 4) + 4 * (l / 16) + lane % 4;
}

/* The 32 values of a row from element `at`, as float32 in wide_element's order. */
static inline __attribute__((always_inline)) void load32(const void *p, int64_t at,
                                                         const int dtype, __m512 *lo,
                                                         __m512 *hi) {
    if (dtype == F32) {
        *lo = _mm512_loadu_ps((const float *)p + at);
        *hi = _mm512_loadu_ps((const float *)p + at + 16);
    } else {
        __m512i v = _mm512_loadu_si512((const uint16_t *)p + at), zero = _mm512_setzero_si512();
        *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
        *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
    }
}

/* Ask for the lines load32 would read at `at`. The 512-bit path asks for the chunk AHEAD
 * chunks on as it reads this one, a line for a line, rather than the whole chunk at once
 * (prefetch_chunk): a burst of a chunk's prefetches (256 lines for Qwen3-0.6B) waits on the few
 * fill buffers with no work beside it, and then the work runs with nothing in flight. Spread
 * out, the step's attention over a 1k context went 13.8 -> 11.6 ms (Qwen3-0.6B) and 5.4 -> 4.4
 * (Llama-3.2-1B) with the cache out of the CPU's caches (bench/decode_attention.py). */
static inline __attribute__((always_inline)) void prefetch32(const void *p, int64_t at,
                                                             const int dtype) {
    const char *line = (const char *)p + at * (dtype == F32 ? 4 : 2);
    __builtin_prefetch(line, 0, 1);
    if (dtype == F32) __builtin_prefetch(line + 64, 0, 1);
}

/* Lane j of the result: the sum of the 16 lanes of v[j], pairing halves as sum_lanes8 does (24
 * vector operations for the 8 sums). */
static inline __attribute__((always_inline)) v8f sum_lanes16(const __m512 v[8]) {
    __m512 t[4], u[2];
    for (int i = 0; i < 4; i++) /* [key 2i: 8 partial sums | key 2i+1: 8] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++) /* [4 keys, a 128-bit lane each: 4 partial sums] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
    /* lane L: [key L: 2 partial sums, key L + 4: 2], then each pair summed */
    __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xee));
    w = _mm512_add_ps(w, _mm512_permute_ps(w, 0xb1));
    const __m512i keys = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return (v8f)_mm512_castps512_ps256(_mm512_permutexvar_ps(keys, w));
}

/* score_chunk on 16 lanes: q in wide_element's order. */
static inline __attribute__((always_inline)) void score_chunk_wide(
    const float *restrict q, const void *k_cache, const int dtype, const int64_t *rows,
    int64_t at, int64_t h0, const int hb, const int64_t d, float scale, float *restrict scores,
    int64_t stride, const int64_t *ahead) {
    __m512 part[HEADS_AT_ONCE][KEYS];
    for (int g = 0; g < hb; g++)
        for (int j = 0; j < KEYS; j++) part[g][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32)
        for (int j = 0; j < KEYS; j++) {
            __m512 lo, hi;
            if (ahead != NULL) prefetch32(k_cache, ahead[j] + at + c, dtype);
            load32(k_cache, rows[j] + at + c, dtype, &lo, &hi);
            for (int g = 0; g < hb; g++) {
                const float *qg = q + (h0 + g) * d + c;
                part[g][j] = _mm512_fmadd_ps(_mm512_loadu_ps(qg), lo, part[g][j]);
                part[g][j] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), hi, part[g][j]);
            }
        }
    for (int g = 0; g < hb; g++) {
        v8f s = sum_lanes16(part[g]) * splat(scale);
        memcpy(scores + (h0 + g) * stride, &s, sizeof s);
    }
}

/* weigh_chunk on 16 lanes: out in wide_element's order. */
static inline __attribute__((always_inline)) void weigh_chunk_wide(
    const float *restrict p, int64_t stride, const void *v_cache, const int dtype,
    const int64_t *rows, int64_t m, int64_t at, int64_t h0, const int hb, const int64_t d,
    float *restrict out, const int64_t *ahead) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const int64_t width = d - c0 < 64 ? d - c0 : 64;
        __m512 acc[HEADS_AT_ONCE][4];
        for (int g = 0; g < hb; g++)
            for (int64_t c = 0; c < width; c += 16)
                acc[g][c / 16] = _mm512_loadu_ps(out + (h0 + g) * d + c0 + c);
        for (int64_t j = 0; j < m; j++) {
            __m512 pj[HEADS_AT_ONCE];
            for (int g = 0; g < hb; g++) pj[g] = _mm512_set1_ps(p[(h0 + g) * stride + j]);
            for (int64_t c = 0; c < width; c += 32) {
                __m512 lo, hi;
                if (ahead != NULL) prefetch32(v_cache, ahead[j] + at + c0 + c, dtype);
                load32(v_cache, rows[j] + at + c0 + c, dtype, &lo, &hi);
                for (int g = 0; g < hb; g++) {
                    acc[g][c / 16] = _mm512_fmadd_ps(pj[g], lo, acc[g][c / 16]);
                    acc[g][c / 16 + 1] = _mm512_fmadd_ps(pj[g], hi, acc[g][c / 16 + 1]);
                }
            }
        }
        for (int g = 0; g < hb; g++)
            for (int64_t c = 0; c < width; c += 16)
                _mm512_storeu_ps(out + (h0 + g) * d + c0 + c, acc[g][c / 16]);
    }
}
#define SCORE_CHUNK(wide, ahead, ...) \
    ((wide) ? score_chunk_wide(__VA_ARGS__, ahead) : score_chunk(__VA_ARGS__))
#define WEIGH_CHUNK(wide, ahead, ...) \
    ((wide) ? weigh_chunk_wide(__VA_ARGS__, ahead) : weigh_chunk(__VA_ARGS__))
#else
#define SCORE_CHUNK(wide, ahead, ...) score_chunk(__VA_ARGS__)
#define WEIGH_CHUNK(wide, ahead, ...) weigh_chunk(__VA_ARGS__)
#endif

/* One sequence, every head: q, out (num_heads, d). Its tokens are taken KEYS at a time, and
 * all heads work on a chunk while its rows (every KV head of a token lies together) are in L1:
 * the cache streams through once, in order within each block. scores: num_heads rows of
 * `stride` floats (n rounded up to KEYS); rows: `stride` int64. Inlined into one copy per
 * common head size, so that d is a constant there and the loops over it unroll. */
static inline __attribute__((always_inline)) void attend_sequence(
    const float *restrict q, const void *k_cache, const void *v_cache, const int dtype,
    const int32_t *table, int64_t len, float *restrict out, int64_t num_heads,
    int64_t num_kv_heads, const int64_t d, int64_t block_size, int64_t block_stride,
    float scale, int64_t window, float soft_cap, const float *sinks, float *restrict scores,
    int64_t *restrict rows, const int wide) {
    int64_t start = (window > 0 && len > window) ? len - window : 0;
    int64_t n = len - start, stride = (n + KEYS - 1) / KEYS * KEYS;
    int64_t group = num_heads / num_kv_heads, pitch = row_pitch(d, dtype);
    /* Where each token's row lies, found once by walking the block table; a partial last chunk
     * reads the first token again (its lanes are never used) instead of branching. */
    for (int64_t i = 0, block = start / block_size, slot = start % block_size; i < n; i++) {
        rows[i] = (int64_t)table[block] * block_stride + slot * num_kv_heads * pitch;
        if (++slot == block_size) slot = 0, block++;
    }
    for (int64_t i = n; i < stride + AHEAD * KEYS; i++) rows[i] = rows[n - 1];
    for (int64_t i0 = 0; i0 < n; i0 += KEYS) {
        if (!wide) prefetch_chunk(k_cache, rows, i0 + AHEAD * KEYS, n, num_kv_heads * pitch, dtype);
        for (int64_t h = 0; h < num_heads;) {
            int64_t at = (h / group) * pitch, left = (h / group + 1) * group - h;
            const int64_t *ahead = h % group == 0 ? rows + i0 + AHEAD * KEYS : NULL;
#define SCORE(hb)                                                                              \
    SCORE_CHUNK(wide, ahead, q, k_cache, dtype, rows + i0, at, h, hb, d, scale, scores + i0,  \
                stride);                                                                       \
    h += hb
            FOR_HEADS_AT_ONCE(left, SCORE)
#undef SCORE
        }
    }
    for (int64_t h = 0; h < num_heads; h++)
        softmax_row(scores + h * stride, 0, n, soft_cap, sinks != NULL ? sinks + h : NULL);
    /* Each output row is accumulated over the tokens in order, as the reference sums them. */
    for (int64_t i = 0; i < num_heads * d; i++) out[i] = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += KEYS) {
        if (!wide) prefetch_chunk(v_cache, rows, i0 + AHEAD * KEYS, n, num_kv_heads * pitch, dtype);
        int64_t m = n - i0 < KEYS ? n - i0 : KEYS;
        for (int64_t h = 0; h < num_heads;) {
            int64_t at = (h / group) * pitch, left = (h / group + 1) * group - h;
            const int64_t *ahead = h % group == 0 ? rows + i0 + AHEAD * KEYS : NULL;
#define WEIGH(hb)                                                                              \
    WEIGH_CHUNK(wide, ahead, scores + i0, stride, v_cache, dtype, rows + i0, m, at, h, hb, d,  \
                out);                                                                          \
    h += hb
            FOR_HEADS_AT_ONCE(left, WEIGH)
#undef WEIGH
        }
    }
}

#define ATTEND(D, DTYPE, WIDE, Q, OUT)                                                         \
    attend_sequence(Q, k_cache, v_cache, DTYPE, table, len, OUT, num_heads, num_kv_heads, D,   \
                    block_size, block_stride, scale, window, soft_cap, sinks, scores, rows, WIDE)

#ifdef WIDE_ATTENTION
/* The 512-bit path's sequence: q put into wide_element's order in `wide` (2 * num_heads * d
 * floats: q's copy, then the output's), the output put back from it. */
static void attend_sequence_wide(const float *q, const void *k_cache, const void *v_cache,
                                 int dtype, const int32_t *table, int64_t len, float *out,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t d,
                                 int64_t block_size, int64_t block_stride, float scale,
                                 int64_t window, float soft_cap, const float *sinks,
                                 float *scores, int64_t *rows, float *wide) {
    float *qw = wide, *outw = wide + num_heads * d;
    for (int64_t u = 0; u < num_heads * d; u += 32)
        for (int64_t l = 0; l < 32; l++) qw[u + l] = q[u + wide_element(l, dtype)];
    if (dtype == F32) {
        switch (d) {
            case 64: ATTEND(64, F32, 1, qw, outw); break;
            case 128: ATTEND(128, F32, 1, qw, outw); break;
            default: ATTEND(d, F32, 1, qw, outw);
        }
    } else {
        switch (d) {
            case 64: ATTEND(64, BF16, 1, qw, outw); break;
            case 128: ATTEND(128, BF16, 1, qw, outw); break;
            default: ATTEND(d, BF16, 1, qw, outw);
        }
    }
    for (int64_t u = 0; u < num_heads * d; u += 32)
        for (int64_t l = 0; l < 32; l++) out[u + wide_element(l, dtype)] = outw[u + l];
}
#endif

/* wide: 2 * num_heads * d floats of scratch for the 512-bit path. */
static void attend_sequence_any(const float *q, const void *k_cache, const void *v_cache,
                                int dtype, const int32_t *table, int64_t len, float *out,
                                int64_t num_heads, int64_t num_kv_heads, int64_t d,
                                int64_t block_size, int64_t block_stride, float scale,
                                int64_t window, float soft_cap, const float *sinks, float *scores,
                                int64_t *rows, float *wide) {
#ifdef WIDE_ATTENTION
    if (dtype != I8 && d % 32 == 0) {
        attend_sequence_wide(q, k_cache, v_cache, dtype, table, len, out, num_heads, num_kv_heads,
                             d, block_size, block_stride, scale, window, soft_cap, sinks, scores,
                             rows, wide);
        return;
    }
#else
    (void)wide;
#endif
    if (dtype == F32) {
        switch (d) {
            case 64: ATTEND(64, F32, 0, q, out); break;
            case 128: ATTEND(128, F32, 0, q, out); break;
            default: ATTEND(d, F32, 0, q, out);
        }
    } else if (dtype == BF16) {
        switch (d) {
            case 64: ATTEND(64, BF16, 0, q, out); break;
            case 128: ATTEND(128, BF16, 0, q, out); break;
            default: ATTEND(d, BF16, 0, q, out);
        }
    } else {
        switch (d) {
            case 64: ATTEND(64, I8, 0, q, out); break;
            case 128: ATTEND(128, I8, 0, q, out); break;
            default: ATTEND(d, I8, 0, q, out);
        }
    }
}

/* q, out: (batch, num_heads, d) float32, d a multiple of 8; block_tables: (batch, max_blocks)
 * int32; context_lens: (batch,) int32, counting the new token. window <= 0: none;
 * soft_cap <= 0: none; sinks: (num_heads,) float32 logits, or NULL. Returns 0, or -1 when
 * scratch memory could not be had. */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                 const int32_t *block_tables, const int32_t *context_lens, float *out,
                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                 int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale,
                 int64_t window, float soft_cap, const float *sinks, int threads) {
    if (d % 8 != 0) abort(); /* cpu_kernels.supports() sends such caches to the torch path */
    int64_t longest = longest_context(context_lens, batch);
    int64_t stride = (longest + KEYS - 1) / KEYS * KEYS;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* per thread: every head's scores, the 512-bit path's q and output, the rows' offsets */
        int64_t floats = num_heads * stride + 2 * num_heads * d;
        float *scores = malloc(sizeof(float) * floats + sizeof(int64_t) * (stride + AHEAD * KEYS));
        if (scores == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t b = 0; b < batch; b++)
                attend_sequence_any(q + b * num_heads * d, k_cache, v_cache, dtype,
                                    block_tables + b * max_blocks, context_lens[b],
                                    out + b * num_heads * d, num_heads, num_kv_heads, d,
                                    block_size, block_stride, scale, window, soft_cap, sinks,
                                    scores, (int64_t *)(scores + floats),
                                    scores + num_heads * stride);
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
 * end at its own position and, with a sliding window, start `window` positions before it: key
 * blocks outside the tile's rows' span are skipped (with a window, the keys before the first
 * new token's window are not even gathered), and within it a row's other keys get probability
 * 0. SmolLM2, 8 prompts of 191 tokens, 30 layers: 0.17 s in float32 or bfloat16, against 0.25
 * for a decode query per token (which reloads the keys for every query) and 0.42 for the torch
 * path. The same prompts with Gemma 2's soft cap of 50 (and its window of 4096, or none):
 * 0.19-0.21 s, where a decode query per token (how these ran before the tiles took them) took
 * 0.66 (libm's tanhf, a call per score); with a window of 64, 0.10 against 0.14, and 0.12
 * against 0.38 with the cap too. A bfloat16 model's queries over a bfloat16 cache go to
 * paged_prefill_bf16 and cpu_prefill_pairs.c instead (AVX512-BF16 hosts): these tiles stay for
 * float32 and int8 caches, float32 queries, and older CPUs. */
#ifdef __AVX512VL__
enum { TILE = 12 }; /* 24 accumulators in AVX-512's 32 registers */
#else
enum { TILE = 6 };
#endif

/* The first key position that a query at `pos` sees. */
static inline int64_t window_start(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* scratch: padded * (2 * d + TILE) floats, padded = total rounded up to 16. */
static inline __attribute__((always_inline)) void prefill_sequence(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
    int64_t total, int64_t queries, float *out, int64_t num_heads, int64_t num_kv_heads,
    int64_t d, int64_t block_size, int64_t block_stride, float scale, int64_t window,
    float soft_cap, const float *sinks, float *scratch, const int dtype) {
    int64_t group = num_heads / num_kv_heads, first_pos = total - queries;
    int64_t pitch = row_pitch(d, dtype);
    /* scratch key i is position base + i: with a window, the keys no new token sees are left */
    int64_t base = window_start(first_pos, window), n = total - base;
    int64_t padded = (n + 15) / 16 * 16, num_rows = queries * group;
    float *keys_t = scratch, *values = scratch + padded * d, *probs = scratch + 2 * padded * d;
    for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
        for (int64_t i = 0; i < padded; i++) {
            int64_t pos = i < n ? base + i : base; /* past the end: zeros, read from anywhere */
            int64_t row = (int64_t)table[pos / block_size] * block_stride +
                          ((pos % block_size) * num_kv_heads + kvh) * pitch;
            /* an I8 row's values times its scale: the tiles below multiply float32 */
            v8f k_scale = splat(row_scale(k_cache, row, d, dtype));
            v8f v_scale = splat(row_scale(v_cache, row, d, dtype));
            for (int64_t c = 0; c < d; c += 8) {
                v8f k = i < n ? load_kv8(k_cache, row + c, dtype) * k_scale : splat(0.0f);
                v8f v = i < n ? load_kv8(v_cache, row + c, dtype) * v_scale : splat(0.0f);
                memcpy(values + i * d + c, &v, sizeof v);
                for (int u = 0; u < 8; u++) keys_t[(c + u) * padded + i] = k[u];
            }
        }
        for (int64_t r0 = 0; r0 < num_rows; r0 += TILE) {
            /* rows r0 .. r0 + TILE - 1 are (token r / group, head kvh * group + r % group); past
             * the last row the tile repeats it (computed, never stored). Row t sees scratch keys
             * lo[t] .. hi[t] - 1; the tile reads key blocks begin .. end. */
            const float *qrow[TILE];
            int64_t at[TILE], lo[TILE], hi[TILE], head[TILE], begin = n, end = 0;
            for (int t = 0; t < TILE; t++) {
                int64_t r = r0 + t < num_rows ? r0 + t : num_rows - 1;
                int64_t pos = first_pos + r / group;
                head[t] = kvh * group + r % group;
                at[t] = ((r / group) * num_heads + head[t]) * d;
                qrow[t] = q + at[t];
                lo[t] = window_start(pos, window) - base;
                hi[t] = pos + 1 - base;
                begin = lo[t] < begin ? lo[t] : begin;
                end = hi[t] > end ? hi[t] : end;
            }
            begin = begin / 16 * 16;
            for (int64_t k0 = begin; k0 < end; k0 += 16) {
                v8f acc[TILE][2];
                for (int t = 0; t < TILE; t++) acc[t][0] = acc[t][1] = splat(0.0f);
                for (int64_t c = 0; c < d; c++) {
                    v8f lo8 = load8(keys_t, c * padded + k0, F32);
                    v8f hi8 = load8(keys_t, c * padded + k0 + 8, F32);
                    for (int t = 0; t < TILE; t++) {
                        v8f qc = splat(qrow[t][c]);
                        acc[t][0] += qc * lo8;
                        acc[t][1] += qc * hi8;
                    }
                }
                for (int t = 0; t < TILE; t++) {
                    v8f a = acc[t][0] * splat(scale), b = acc[t][1] * splat(scale);
                    memcpy(probs + t * padded + k0, &a, sizeof a);
                    memcpy(probs + t * padded + k0 + 8, &b, sizeof b);
                }
            }
            int64_t blocks_end = (end + 15) / 16 * 16;
            for (int t = 0; t < TILE; t++) {
                float *row = probs + t * padded;
                softmax_row(row, lo[t], hi[t], soft_cap, sinks != NULL ? sinks + head[t] : NULL);
                for (int64_t i = begin; i < lo[t]; i++) row[i] = 0.0f;
                for (int64_t i = hi[t]; i < blocks_end; i++) row[i] = 0.0f;
            }
            for (int64_t c0 = 0; c0 < d; c0 += 16) {
                v8f acc[TILE][2];
                for (int t = 0; t < TILE; t++) acc[t][0] = acc[t][1] = splat(0.0f);
                for (int64_t i = begin; i < end; i++) {
                    v8f lo8 = load8(values, i * d + c0, F32);
                    v8f hi8 = c0 + 8 < d ? load8(values, i * d + c0 + 8, F32) : splat(0.0f);
                    for (int t = 0; t < TILE; t++) {
                        v8f p = splat(probs[t * padded + i]);
                        acc[t][0] += p * lo8;
                        acc[t][1] += p * hi8;
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

/* cpu_prefill_pairs.c: the bfloat16 cache's dot-product path (its comment says when and why). */
int prefill_pairs_available(void);
int64_t prefill_pairs_scratch(int64_t n, int64_t d);
int prefill_amx_ready(void); /* its AMX tiles: the CPU has them, Linux lent them, not turned off */
void prefill_pairs(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                   const int32_t *table, int64_t total, int64_t queries, uint16_t *out,
                   int64_t num_heads, int64_t num_kv_heads, int64_t kvh, int64_t d,
                   int64_t block_size, int64_t block_stride, float scale, int64_t window,
                   float soft_cap, const float *sinks, void *scratch, int amx);

/* paged_prefill for a bfloat16 model's queries over a bfloat16 cache, by cpu_prefill_pairs.c (a
 * task per (sequence, KV head)): q, out (num_tokens, num_heads, d) bfloat16, d a multiple of
 * 16; the rest as paged_prefill's. Only where prefill_pairs_available(). */
int paged_prefill_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
                       const int32_t *block_tables, const int32_t *cu_seqlens_q,
                       const int32_t *context_lens, uint16_t *out, int64_t batch,
                       int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t block_size,
                       int64_t block_stride, int64_t max_blocks, float scale, int64_t window,
                       float soft_cap, const float *sinks, int threads) {
    if (d % 16 != 0 || !prefill_pairs_available()) abort(); /* cpu_kernels.py checks both */
    int64_t bytes = prefill_pairs_scratch(longest_context(context_lens, batch), d);
    int failed = 0, amx = prefill_amx_ready();
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        void *scratch = thread_scratch(bytes);
        if (scratch == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t task = 0; task < batch * num_kv_heads; task++) {
                int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
                int64_t start = cu_seqlens_q[b], queries = cu_seqlens_q[b + 1] - start;
                if (queries == 0) continue;
                prefill_pairs(q + start * num_heads * d, k_cache, v_cache,
                              block_tables + b * max_blocks, context_lens[b], queries,
                              out + start * num_heads * d, num_heads, num_kv_heads, kvh, d,
                              block_size, block_stride, scale, window, soft_cap, sinks, scratch,
                              amx);
            }
        }
    }
    return failed ? -1 : 0;
}

/* q, out: (num_tokens, num_heads, d) float32, d a multiple of 8, the sequences' new tokens back
 * to back (cu_seqlens_q: (batch + 1,) int32); context_lens: (batch,) int32, each sequence's
 * cached prefix plus its new tokens. window, soft_cap, sinks: as paged_decode's. Returns 0, or
 * -1 when scratch memory could not be had. */
int paged_prefill(const float *q, const void *k_cache, const void *v_cache, int dtype,
                  const int32_t *block_tables, const int32_t *cu_seqlens_q,
                  const int32_t *context_lens, float *out, int64_t batch, int64_t num_heads,
                  int64_t num_kv_heads, int64_t d, int64_t block_size, int64_t block_stride,
                  int64_t max_blocks, float scale, int64_t window, float soft_cap,
                  const float *sinks, int threads) {
    if (d % 8 != 0) abort(); /* cpu_kernels.supports() sends such caches to the torch path */
    int64_t padded = (longest_context(context_lens, batch) + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scratch = thread_scratch(sizeof(float) * padded * (2 * d + TILE));
        if (scratch == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t b = 0; b < batch; b++) {
                int64_t start = cu_seqlens_q[b], queries = cu_seqlens_q[b + 1] - start;
                if (queries == 0) continue;
                WITH_KV_DTYPE(dtype, prefill_sequence, q + start * num_heads * d, k_cache, v_cache,
                           block_tables + b * max_blocks, context_lens[b], queries,
                           out + start * num_heads * d, num_heads, num_kv_heads, d, block_size,
                           block_stride, scale, window, soft_cap, sinks, scratch);
            }
        }
    }
    return failed ? -1 : 0;
}

/* One row of d values (src_dtype, F32 or BF16) as the cache stores it (F32, BF16 or I8 with its
 * scale: max |x| / 127, values rint(x / scale), kv_quant.quantize's arithmetic), at dst. */
static void store_row(const void *src, int64_t at, int src_dtype, void *dst, int dtype,
                      int64_t d) {
    if (dtype == src_dtype) {
        memcpy(dst, (const char *)src + at * kv_elem_bytes(dtype), d * kv_elem_bytes(dtype));
    } else if (dtype != I8) {
        for (int64_t c = 0; c < d; c++) put(dst, c, get(src, at + c, src_dtype), dtype);
    } else {
        float peak = 0.0f;
        for (int64_t c = 0; c < d; c++) peak = fmaxf(peak, fabsf(get(src, at + c, src_dtype)));
        float scale = peak / 127.0f;
        for (int64_t c = 0; c < d; c++) {
            float q = scale > 0.0f ? rintf(get(src, at + c, src_dtype) / scale) : 0.0f;
            ((int8_t *)dst)[c] = (int8_t)fminf(fmaxf(q, -127.0f), 127.0f);
        }
        memcpy((char *)dst + d, &scale, sizeof scale);
    }
}

/* Write k, v: (num_tokens, num_kv_heads * d) of src_dtype at slot_mapping (block * block_size +
 * offset) into a cache of `dtype` (converted, or quantized for I8); negative slots (padding)
 * are skipped. block_stride: in the cache's elements (bytes for I8). */
void store_kv(const void *k, const void *v, int src_dtype, void *k_cache, void *v_cache,
              int dtype, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
              int64_t d, int64_t block_size, int64_t block_stride) {
    int64_t pitch = row_pitch(d, dtype), elem = kv_elem_bytes(dtype);
    for (int64_t i = 0; i < num_tokens; i++) {
        int64_t slot = slot_mapping[i];
        if (slot < 0) continue;
        int64_t first =
            (slot / block_size) * block_stride + (slot % block_size) * num_kv_heads * pitch;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            int64_t at = (first + h * pitch) * elem, from = (i * num_kv_heads + h) * d;
            store_row(k, from, src_dtype, (char *)k_cache + at, dtype, d);
            store_row(v, from, src_dtype, (char *)v_cache + at, dtype, d);
        }
    }
}

/* cpu_rows_bf16.c: the bfloat16 rows of the four kernels below on 16 lanes (AVX512-BF16). */
int rows_bf16_available(void);
void rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                   int64_t rows, int64_t dim, float eps, int gemma);
void rms_norm_heads_bf16(uint16_t *x, int64_t token_stride, int64_t tokens, int64_t heads,
                         int64_t d, const uint16_t *weight, float eps, int gemma);
void rope_bf16(uint16_t *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
               int64_t rotary_dim, const int64_t *positions, const float *cos, const float *sin);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter);

/* RMSNorm of the dim values at x + at into out + out_at, in the order Hugging Face computes it,
 * in float32 from x * rsqrt(mean(x^2) + eps): Llama's (gemma 0) rounds that to the dtype, then
 * multiplies by the weight (one more rounding); Gemma's (gemma 1) multiplies by (1 + weight)
 * in float32 and rounds once. In place (out == x, out_at == at) is fine: the row is read whole
 * before it is written. */
static inline __attribute__((always_inline)) void norm_row(
    const void *x, int64_t at, const void *weight, void *out, int64_t out_at, int64_t dim,
    float eps, const int gemma, const int dtype) {
    float sum = 0.0f;
    for (int64_t j = 0; j < dim; j++) {
        float v = get(x, at + j, dtype);
        sum += v * v;
    }
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t j = 0; j < dim; j++) {
        float v = get(x, at + j, dtype) * inv, w = get(weight, j, dtype);
        put(out, out_at + j, gemma ? v * (1.0f + w) : w * held(v, dtype), dtype);
    }
}

/* RMSNorm over rows of x: (rows, dim), written to out. With a residual, the row normalised is
 * residual + x (rounded to the dtype, as torch's add), which is stored back into residual first
 * (the decoder's skip connection, one pass instead of an add and a norm). */
static inline __attribute__((always_inline)) void rms_norm_rows(
    const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
    float eps, const int gemma, const int dtype) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t at = r * dim;
        if (residual != NULL)
            for (int64_t j = 0; j < dim; j++)
                put(residual, at + j, get(residual, at + j, dtype) + get(x, at + j, dtype), dtype);
        norm_row(residual != NULL ? residual : x, at, weight, out, at, dim, eps, gemma, dtype);
    }
}

/* gemma: 0 for Llama's rounding, 1 for Gemma's (1 + weight); see norm_row. */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows,
              int64_t dim, float eps, int gemma, int dtype) {
    if (dtype == BF16 && rows_bf16_available())
        rms_norm_bf16(x, residual, weight, out, rows, dim, eps, gemma);
    else if (gemma)
        WITH_DTYPE(dtype, rms_norm_rows, x, residual, weight, out, rows, dim, eps, 1);
    else
        WITH_DTYPE(dtype, rms_norm_rows, x, residual, weight, out, rows, dim, eps, 0);
}

static inline __attribute__((always_inline)) void norm_heads(
    void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d, const void *weight,
    float eps, const int gemma, const int dtype) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t at = t * token_stride + h * d;
            norm_row(x, at, weight, x, at, d, eps, gemma, dtype);
        }
}

/* Per-head RMSNorm in place (Qwen3's and Gemma 3's q/k norms): x (tokens, heads, d), each
 * head's d values contiguous, heads back to back, rows token_stride elements apart (q or k
 * inside the fused projection's rows); weight (d,). */
void rms_norm_heads(void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d,
                    const void *weight, float eps, int gemma, int dtype) {
    if (dtype == BF16 && rows_bf16_available())
        rms_norm_heads_bf16(x, token_stride, tokens, heads, d, weight, eps, gemma);
    else if (gemma)
        WITH_DTYPE(dtype, norm_heads, x, token_stride, tokens, heads, d, weight, eps, 1);
    else
        WITH_DTYPE(dtype, norm_heads, x, token_stride, tokens, heads, d, weight, eps, 0);
}

/* Rotary embedding in place (rotate-half form) on x: (tokens, heads, d) with rows token_stride
 * elements apart and each head's d values contiguous; cos, sin: (positions, rotary_dim) float32
 * tables. The first rotary_dim values of each head are rotated (halves rotary_dim / 2 apart),
 * the rest left as they are (Phi-3's partial rotary; rotary_dim = d for the others). Computed
 * in float32, as the reference does, and rounded once to the dtype. */
static inline __attribute__((always_inline)) void rope_rows(
    void *x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t d, int64_t rotary_dim,
    const int64_t *positions, const float *cos, const float *sin, const int dtype) {
    int64_t half = rotary_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * rotary_dim, *s = sin + positions[t] * rotary_dim;
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
          int64_t rotary_dim, const int64_t *positions, const float *cos, const float *sin,
          int dtype) {
    if (dtype == BF16 && rows_bf16_available())
        rope_bf16(x, token_stride, tokens, heads, d, rotary_dim, positions, cos, sin);
    else
        WITH_DTYPE(dtype, rope_rows, x, token_stride, tokens, heads, d, rotary_dim, positions,
                   cos, sin);
}

/* The activations of the gated MLPs, in float32 (torch computes a bfloat16 tensor's in float32
 * and rounds once). exp_clamped and tanh_clamped stand for torch's vectorised exp and tanh: all
 * within a unit or two in the last place of float32. */
enum { SILU = 0, GELU_TANH = 1 };

/* torch's gelu(approximate="tanh"), its operations in its order (Gemma's gelu_pytorch_tanh). */
static inline float gelu_tanh(float g) {
    float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    return 0.5f * g * (1.0f + tanh_clamped(inner));
}

/* act(gate) * up over rows of gate_up (rows, 2 * inter), the gate's inter values then the up's,
 * into out (rows, inter); each op rounded to the dtype as torch's activation and product are. */
static inline __attribute__((always_inline)) void gated_rows(const void *gate_up, void *out,
                                                             int64_t rows, int64_t inter,
                                                             const int act, const int dtype) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t gate = r * 2 * inter, up = gate + inter;
        for (int64_t j = 0; j < inter; j++) {
            float g = get(gate_up, gate + j, dtype);
            float a = held(act == SILU ? silu(g) : gelu_tanh(g), dtype);
            put(out, r * inter + j, a * get(gate_up, up + j, dtype), dtype);
        }
    }
}

/* silu(gate) * up (Llama's MLP). */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype) {
    if (dtype == BF16 && rows_bf16_available())
        silu_mul_bf16(gate_up, out, rows, inter);
    else
        WITH_DTYPE(dtype, gated_rows, gate_up, out, rows, inter, SILU);
}

/* gelu_tanh(gate) * up (Gemma's MLP). */
void gelu_tanh_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype) {
    WITH_DTYPE(dtype, gated_rows, gate_up, out, rows, inter, GELU_TANH);
}
