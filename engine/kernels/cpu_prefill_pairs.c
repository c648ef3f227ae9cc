/* Prefill attention over a bfloat16 cache with AVX512-BF16's dot products (`vdpbf16ps`): the
 * path of a bfloat16 model's queries over a bfloat16 cache (cpu_kernels.c's paged_prefill_bf16),
 * so that nothing is rounded that the model had not rounded already, except the probabilities
 * (see below) and the output, rounded to bfloat16 once as the model's dtype would round it.
 * The queries come in and the output goes out in bfloat16: widening them to float32 around
 * the call was two more passes over activations of megabytes (3-4 ms a layer at Qwen3-0.6B's
 * 1k-token prefill).
 *
 * Why: the float32 tiles (cpu_kernels.c's prefill_sequence) multiply-add eight float32 lanes an
 * instruction and hold every score of a tile's rows, ~85 GFLOPS on the dev VM's Zen 4, where
 * `vdpbf16ps` does 32 multiply-adds an instruction (the linear layers reach ~490 GFLOPS with
 * it). Attention grows with the square of the prompt, so at 4k and 8k tokens it is most of the
 * time to first token.
 *
 * How, for one (sequence, KV head): its keys and values are packed once into the instruction's
 * pair layout, keys as [key / 16][d / 2][16][2] (a vector holds 16 keys' two adjacent
 * elements) and values as [key / 2][d][2] (a vector holds 16 columns of two adjacent keys).
 * Query rows, (token, query head of the group) token-major, are taken BQ at a time; each such
 * block walks the key blocks (BK keys) that its rows can see, causal and windowed spans
 * skipped, flash-attention style: scores S = q K^T in 12-row x 32-key register tiles (each key
 * vector loaded once for 12 rows, each query pair broadcast from memory), a running maximum and
 * sum per row in float32 (online softmax, in base 2: the output so far rescaled when the
 * maximum moves), the probabilities summed in float32 and rounded to bfloat16 for the product
 * (as torch's own CPU flash attention does for a bfloat16 model), multiplied into the output in
 * 6-row x 64-column register tiles. Soft caps apply to the scores before the maximum; a sink
 * starts each row's maximum at its logit and its sum at 1 (one more key with no value), so the
 * row's weights sum to less than one.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dtypes.h"

#ifdef __AVX512BF16__
#include <immintrin.h>

int prefill_pairs_available(void) { return 1; }

enum { BQ = 48 };   /* query rows a block: 4 score tiles of 12, 8 output tiles of 6 */
enum { BK = 256 }; /* keys a block: BQ rows' scores in L2 (64 and 128 keys: ~5% slower) */
enum { SR = 12 };   /* rows of a score tile: 24 accumulators of 2 x 16 keys */
enum { OR = 6 };
#define LOG2E 1.44269504088896341f
#define LN2 0.69314718055994531f    /* rows of an output tile: 24 accumulators of 4 x 16 columns */

/* Where query row r of KV head kvh lies in q and out: token r / group, query head
 * kvh * group + r % group (a GQA group's heads side by side). */
static inline int64_t row_offset(int64_t r, int64_t group, int64_t num_heads, int64_t kvh,
                                 int64_t d) {
    return ((r / group) * num_heads + kvh * group + r % group) * d;
}

/* The first key position that a query at `pos` sees (cpu_kernels.c's window_start). */
static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* Scores of SR rows of qb (bf16, d a row) against the 32 keys of packed blocks kp, kp + 16 * d:
 * s[t][0 .. 32) = q_t . k_j (the softmax scales them). */
static inline __attribute__((always_inline)) void score_tile(
    const uint16_t *restrict qb, const uint16_t *restrict kp, const int64_t d,
    float *restrict s) {
    __m512 acc[SR][2];
    for (int t = 0; t < SR; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; p++) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * 32);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + 16 * d + p * 32);
        for (int t = 0; t < SR; t++) {
            uint32_t pair;
            memcpy(&pair, qb + t * d + 2 * p, sizeof pair);
            __m512bh q = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], k0, q);
            acc[t][1] = _mm512_dpbf16_ps(acc[t][1], k1, q);
        }
    }
    for (int t = 0; t < SR; t++) {
        _mm512_storeu_ps(s + t * BK, acc[t][0]);
        _mm512_storeu_ps(s + t * BK + 16, acc[t][1]);
    }
}

/* o[t][c0 .. c0 + 16 W) = o * alpha[t] + sum over key pairs [p0, p1) of the block of
 * pb[t][2p, 2p + 1] . (v[2p][c], v[2p + 1][c]), for OR rows. */
static inline __attribute__((always_inline)) void weigh_tile(
    const uint16_t *restrict pb, const uint16_t *restrict vp, const int64_t d, int64_t p0,
    int64_t p1, const float *alpha, float *restrict o, int64_t c0, const int W) {
    __m512 acc[OR][4];
    for (int t = 0; t < OR; t++) {
        __m512 a = _mm512_set1_ps(alpha[t]);
        for (int w = 0; w < W; w++)
            acc[t][w] = _mm512_mul_ps(_mm512_loadu_ps(o + t * d + c0 + 16 * w), a);
    }
    for (int64_t p = p0; p < p1; p++) {
        __m512bh v[4];
        for (int w = 0; w < W; w++)
            v[w] = (__m512bh)_mm512_loadu_si512(vp + p * 2 * d + 2 * (c0 + 16 * w));
        for (int t = 0; t < OR; t++) {
            uint32_t pair;
            memcpy(&pair, pb + t * BK + 2 * p, sizeof pair);
            __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int w = 0; w < W; w++) acc[t][w] = _mm512_dpbf16_ps(acc[t][w], v[w], pr);
        }
    }
    for (int t = 0; t < OR; t++)
        for (int w = 0; w < W; w++) _mm512_storeu_ps(o + t * d + c0 + 16 * w, acc[t][w]);
}

/* The maximum of peak and row[a .. b): whole vectors, then a masked tail (a mask made every
 * step was a fifth of the softmax's instructions). */
static inline float row_max(const float *row, int64_t a, int64_t b, float peak) {
    __m512 best = _mm512_set1_ps(peak);
    int64_t j = a;
    for (; j + 16 <= b; j += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(row + j));
    if (j < b) {
        __mmask16 tail = lanes_below(j, b);
        best = _mm512_mask_max_ps(best, tail, best, _mm512_maskz_loadu_ps(tail, row + j));
    }
    return _mm512_reduce_max_ps(best);
}

/* 2^x on 16 lanes: 2^n (vscalefps, which takes n as a float and gives 0 far below the range)
 * times 2^f, f = x - n in [-0.5, 0.5], by its Taylor series to f^5 (relative error < 3e-6,
 * far inside the bfloat16 rounding that follows). Scores are kept in base 2 (times log2(e))
 * for this: eight vector operations where exp_clamped's form takes nineteen, and the softmax
 * was a third of the kernel's time. */
static inline __m512 exp2_16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);                 /* ln2^5 / 5! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));  /* ln2^4 / 4! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));  /* ln2^3 / 3! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));  /* ln2^2 / 2! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));  /* ln2 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 2^(x * unit - peak) of 16 scores, their bfloat16 roundings stored at dst (the lanes of
 * `lanes`), and the unrounded values added into *sum. */
static inline __attribute__((always_inline)) void probs16(__m512 x, __m512 unit, __m512 peak,
                                                          uint16_t *dst, __mmask16 lanes,
                                                          __m512 *sum) {
    __m512 e = exp2_16(_mm512_fmsub_ps(x, unit, peak));
    _mm256_mask_storeu_epi16(dst, lanes, (__m256i)_mm512_cvtneps_pbh(e));
    *sum = _mm512_mask_add_ps(*sum, lanes, *sum, e);
}

/* prow[a .. b) = 2^(row * unit - peak) (unit: what takes the row's scores to base 2), rounded
 * to bfloat16 as `vcvtneps2bf16` rounds (to nearest even), for the output's product; returns
 * their sum before the rounding, as torch's CPU flash attention sums them. */
static inline float row_probs(const float *row, int64_t a, int64_t b, float unit, float peak,
                              uint16_t *prow) {
    __m512 sum = _mm512_setzero_ps(), top = _mm512_set1_ps(peak), by = _mm512_set1_ps(unit);
    int64_t j = a;
    for (; j + 16 <= b; j += 16)
        probs16(_mm512_loadu_ps(row + j), by, top, prow + j, (__mmask16)0xffff, &sum);
    if (j < b) {
        __mmask16 tail = lanes_below(j, b);
        probs16(_mm512_maskz_loadu_ps(tail, row + j), by, top, prow + j, tail, &sum);
    }
    return _mm512_reduce_add_ps(sum);
}

/* --- AMX tiles (Sapphire Rapids and later) ---------------------------------------------------
 * Where the CPU has AMX-BF16, the two products run as tile multiplications instead: one
 * `tdpbf16ps` multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one (8,192 multiply-adds) into
 * 16 x 16 float32 accumulators. On the project's Xeon host the dot products above run at
 * 92-103 GFLOPS (a third of what they reach on the Zen 4 host), the tiles at 318-453: 3.4-4.6x
 * over 1k-8k-token prompts (bench/prefill_attention.py), the rest of the kernel (the softmax,
 * packing, the scaling passes) now most of its time. The layouts above are the tiles' own: a
 * 16-key block of kp is a B tile of the scores (16 rows of key pairs, 64 bytes each), 32 keys
 * of vp's pairs a B tile of the output (row stride 4 d bytes), a row tile's queries or
 * probabilities an A tile. Rows go in tiles of 16 (BQ is three), d in tiles of 32 (other head
 * sizes keep the dot products); everything else (the online softmax, masks, caps, sinks) is the
 * code above. The permission and the tile shape: cpu_amx.h. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "cpu_amx.h"

static int amx_wanted = 1; /* prefill_amx_use(0) runs the dot products on an AMX host too */

void prefill_amx_use(int on) { amx_wanted = on; }

int prefill_amx_ready(void) { return amx_wanted && amx_permitted(); }

/* score_tile for 16 rows: s[t][0 .. 32) = q_t . k_j, tiles 0-1 the scores, 2 the queries,
 * 3-4 the two 16-key blocks of kp. */
static inline __attribute__((always_inline)) void score_tile_amx(
    const uint16_t *restrict qb, const uint16_t *restrict kp, const int64_t d,
    float *restrict s) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < d; c += 32) {
        _tile_loadd(2, qb + c, d * 2);
        _tile_loadd(3, kp + c * 16, 64);
        _tile_loadd(4, kp + 16 * d + c * 16, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, s, BK * 4);
    _tile_stored(1, s + 16, BK * 4);
}

/* weigh_tile for 16 rows and every column: o = o * alpha + the key pairs [p0, p1) of the block
 * (multiples of 16) of pb . v; tiles 0-3 four 16-column blocks of o, 4 the probabilities, 5
 * the values. */
static inline __attribute__((always_inline)) void weigh_rows_amx(
    const uint16_t *restrict pb, const uint16_t *restrict vp, const int64_t d, int64_t p0,
    int64_t p1, const float *alpha, float *restrict o) {
    for (int t = 0; t < TR; t++) {
        if (alpha[t] == 1.0f) continue; /* the row's maximum stayed (most blocks past the first) */
        __m512 a = _mm512_set1_ps(alpha[t]);
        for (int64_t c = 0; c < d; c += 16)
            _mm512_storeu_ps(o + t * d + c, _mm512_mul_ps(_mm512_loadu_ps(o + t * d + c), a));
    }
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const int64_t w = (d - c0) / 16 < 4 ? (d - c0) / 16 : 4;
        float *oc = o + c0;
        const uint16_t *vc = vp + 2 * c0;
        _tile_loadd(0, oc, d * 4);
        if (w > 1) _tile_loadd(1, oc + 16, d * 4);
        if (w > 2) _tile_loadd(2, oc + 32, d * 4);
        if (w > 3) _tile_loadd(3, oc + 48, d * 4);
        for (int64_t p = p0; p < p1; p += 16) {
            const uint16_t *vr = vc + p * 2 * d;
            _tile_loadd(4, pb + 2 * p, BK * 2);
            _tile_loadd(5, vr, d * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (w > 1) {
                _tile_loadd(5, vr + 32, d * 4);
                _tile_dpbf16ps(1, 4, 5);
            }
            if (w > 2) {
                _tile_loadd(5, vr + 64, d * 4);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (w > 3) {
                _tile_loadd(5, vr + 96, d * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, oc, d * 4);
        if (w > 1) _tile_stored(1, oc + 16, d * 4);
        if (w > 2) _tile_stored(2, oc + 32, d * 4);
        if (w > 3) _tile_stored(3, oc + 48, d * 4);
    }
}
#else
enum { TR = 16 };
void prefill_amx_use(int on) { (void)on; }
int prefill_amx_ready(void) { return 0; }
static void configure_tiles(void) {}
static void release_tiles(void) {}
static inline void score_tile_amx(const uint16_t *qb, const uint16_t *kp, int64_t d, float *s) {
    abort();
}
static inline void weigh_rows_amx(const uint16_t *pb, const uint16_t *vp, int64_t d, int64_t p0,
                                  int64_t p1, const float *alpha, float *o) { abort(); }
#endif

/* Scratch (bytes) of one call of prefill_pairs for keys n and head size d. */
int64_t prefill_pairs_scratch(int64_t n, int64_t d) {
    int64_t padded = (n + 31) / 32 * 32;
    return 2 * padded * d * 2                /* packed keys and values */
           + BQ * d * 2 + BQ * BK * 2        /* the block's queries, probabilities (bf16) */
           + BQ * BK * 4 + BQ * d * 4        /* scores, output rows */
           + BQ * 4 * 3 + BQ * 8 * 2 + 256;  /* max, sum, alpha; key spans; alignment */
}

static inline __attribute__((always_inline)) void prefill_pairs_d(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
    int64_t total, int64_t queries, uint16_t *out, int64_t num_heads, int64_t num_kv_heads,
    int64_t kvh, const int64_t d, int64_t block_size, int64_t block_stride, float scale,
    int64_t window, float soft_cap, const float *sinks, void *scratch, const int amx) {
    int64_t group = num_heads / num_kv_heads, first_pos = total - queries;
    int64_t base = first_key(first_pos, window), n = total - base;
    int64_t padded = (n + 31) / 32 * 32, num_rows = queries * group;
    char *at = (char *)(((uintptr_t)scratch + 63) / 64 * 64);
    uint16_t *kp = (uint16_t *)at, *vp = kp + padded * d, *qb = vp + padded * d;
    uint16_t *pb = qb + BQ * d;
    float *s = (float *)(pb + BQ * BK), *o = s + BQ * BK, *m = o + BQ * d, *l = m + BQ;
    float *alpha = l + BQ;
    int64_t *lo = (int64_t *)(alpha + BQ), *hi = lo + BQ;
    /* the tiles' q . k times `unit` is the score in base 2 (log2(e) in the scale), which the
     * softmax multiplies in as it reads them; a soft cap scales and caps them first */
    float unit = soft_cap > 0.0f ? 1.0f : scale * LOG2E;
    /* pack: key i (position base + i) at kp[i / 16][c / 2][i % 16][c % 2], value at
     * vp[i / 2][c][i % 2]; past n zeros */
    for (int64_t i = 0; i < padded; i++) {
        uint16_t *kd = kp + (i / 16) * 16 * d + (i % 16) * 2, *vd = vp + (i / 2) * 2 * d + i % 2;
        if (i >= n) {
            for (int64_t c = 0; c < d; c += 2) kd[c * 16] = kd[c * 16 + 1] = 0;
            for (int64_t c = 0; c < d; c++) vd[2 * c] = 0;
            continue;
        }
        int64_t pos = base + i;
        int64_t row = (int64_t)table[pos / block_size] * block_stride +
                      ((pos % block_size) * num_kv_heads + kvh) * d;
        const uint16_t *kr = k_cache + row, *vr = v_cache + row;
        for (int64_t c = 0; c < d; c += 2) kd[c * 16] = kr[c], kd[c * 16 + 1] = kr[c + 1];
        for (int64_t c = 0; c < d; c++) vd[2 * c] = vr[c];
    }
    for (int64_t r0 = 0; r0 < num_rows; r0 += BQ) {
        int64_t rows = num_rows - r0 < BQ ? num_rows - r0 : BQ;
        /* rows computed (past `rows`, the last row again): whole score and output tiles */
        int64_t rows_sr = (rows + SR - 1) / SR * SR, rows_or = (rows + OR - 1) / OR * OR;
        if (amx) rows_sr = rows_or = (rows + TR - 1) / TR * TR;
        int64_t klo = n, khi = 0;
        for (int64_t t = 0; t < BQ; t++) {
            /* past the last row: the last row again (computed, never stored) */
            int64_t r = r0 + (t < rows ? t : rows - 1), pos = first_pos + r / group;
            int64_t head = kvh * group + r % group;
            memcpy(qb + t * d, q + row_offset(r, group, num_heads, kvh, d), d * sizeof *qb);
            lo[t] = first_key(pos, window) - base;
            hi[t] = pos + 1 - base;
            klo = lo[t] < klo ? lo[t] : klo;
            khi = hi[t] > khi ? hi[t] : khi;
            m[t] = sinks != NULL ? sinks[head] * LOG2E : -INFINITY;
            l[t] = sinks != NULL ? 1.0f : 0.0f;
            for (int64_t c = 0; c < d; c++) o[t * d + c] = 0.0f;
        }
        /* the next block's query rows, a token's (num_heads * d values) apart: the hardware
         * prefetcher does not cross pages, and their misses were 5-7% of a 4k-token prefill */
        for (int64_t r = r0 + BQ; r < r0 + 2 * BQ && r < num_rows; r++) {
            const char *row = (const char *)(q + row_offset(r, group, num_heads, kvh, d));
            for (int64_t c = 0; c < d * 2; c += 64) _mm_prefetch(row + c, _MM_HINT_T0);
        }
        klo = klo / 32 * 32;
        for (int64_t k0 = klo; k0 < khi; k0 += BK) {
            int64_t kn = (khi - k0 < BK ? khi - k0 : BK);
            kn = (kn + 31) / 32 * 32; /* within padded: the packed zeros past n */
            for (int64_t t0 = 0; t0 < rows_sr; t0 += amx ? TR : SR) {
                /* skip a tile none of whose rows sees this block */
                int64_t tlo = n, thi = 0;
                for (int64_t t = t0; t < t0 + (amx ? TR : SR); t++) {
                    tlo = lo[t] < tlo ? lo[t] : tlo;
                    thi = hi[t] > thi ? hi[t] : thi;
                }
                for (int64_t j = 0; j < kn; j += 32)
                    if (k0 + j >= thi || k0 + j + 32 <= tlo) continue;
                    else if (amx)
                        score_tile_amx(qb + t0 * d, kp + (k0 + j) * d, d, s + t0 * BK + j);
                    else
                        score_tile(qb + t0 * d, kp + (k0 + j) * d, d, s + t0 * BK + j);
            }
            int64_t pair_lo = kn / 2, pair_hi = 0; /* key pairs any row weighs */
            for (int64_t t = 0; t < rows_or; t++) {
                float *row = s + t * BK;
                uint16_t *prow = pb + t * BK;
                int64_t a = lo[t] - k0, b = hi[t] - k0;
                a = a < 0 ? 0 : a > kn ? kn : a;
                b = b < 0 ? 0 : b > kn ? kn : b;
                if (a >= b) {
                    memset(prow, 0, kn * sizeof *prow);
                    alpha[t] = 1.0f;
                    continue;
                }
                memset(prow, 0, a * sizeof *prow); /* [a, b) row_probs writes */
                memset(prow + b, 0, (kn - b) * sizeof *prow);
                pair_lo = a / 2 < pair_lo ? a / 2 : pair_lo;
                pair_hi = (b + 1) / 2 > pair_hi ? (b + 1) / 2 : pair_hi;
                if (soft_cap > 0.0f)
                    for (int64_t j = a; j < b; j++)
                        row[j] = soft_cap * tanh_clamped(row[j] * scale / soft_cap) * LOG2E;
                float top = unit * row_max(row, a, b, -INFINITY), peak = top > m[t] ? top : m[t];
                alpha[t] = m[t] == peak ? 1.0f
                           : m[t] == -INFINITY ? 0.0f
                                               : exp_clamped((m[t] - peak) * LN2);
                l[t] = l[t] * alpha[t] + row_probs(row, a, b, unit, peak, prow);
                m[t] = peak;
            }
            if (pair_lo >= pair_hi) continue;
            if (amx) { /* whole tiles of 16 pairs (32 keys): the probabilities outside are 0 */
                pair_lo = pair_lo / 16 * 16;
                pair_hi = (pair_hi + 15) / 16 * 16;
                for (int64_t t0 = 0; t0 < rows_or; t0 += TR)
                    weigh_rows_amx(pb + t0 * BK, vp + k0 * d, d, pair_lo, pair_hi, alpha + t0,
                                   o + t0 * d);
                continue;
            }
            for (int64_t t0 = 0; t0 < rows_or; t0 += OR) {
                int64_t c0 = 0;
                for (; c0 + 64 <= d; c0 += 64)
                    weigh_tile(pb + t0 * BK, vp + k0 * d, d, pair_lo, pair_hi, alpha + t0,
                               o + t0 * d, c0, 4);
                switch ((d - c0) / 16) {
                    case 1: weigh_tile(pb + t0 * BK, vp + k0 * d, d, pair_lo, pair_hi,
                                       alpha + t0, o + t0 * d, c0, 1); break;
                    case 2: weigh_tile(pb + t0 * BK, vp + k0 * d, d, pair_lo, pair_hi,
                                       alpha + t0, o + t0 * d, c0, 2); break;
                    case 3: weigh_tile(pb + t0 * BK, vp + k0 * d, d, pair_lo, pair_hi,
                                       alpha + t0, o + t0 * d, c0, 3); break;
                    default: break;
                }
            }
        }
        for (int64_t t = 0; t < rows; t++) {
            uint16_t *dst = out + row_offset(r0 + t, group, num_heads, kvh, d);
            __m512 inv = _mm512_set1_ps(l[t] > 0.0f ? 1.0f / l[t] : 0.0f);
            for (int64_t c = 0; c < d; c += 16) /* rounded to nearest even, as torch's .to() */
                _mm256_storeu_si256((__m256i *)(dst + c),
                                    (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_mul_ps(_mm512_loadu_ps(o + t * d + c), inv)));
        }
    }
}

#define PAIRS(D)                                                                               \
    prefill_pairs_d(q, k_cache, v_cache, table, total, queries, out, num_heads, num_kv_heads,  \
                    kvh, D, block_size, block_stride, scale, window, soft_cap, sinks, scratch, \
                    amx)

/* One KV head `kvh` of one sequence: q, out as paged_prefill_bf16's (this sequence's first
 * token), total keys (prefix and new), `queries` new tokens; d a multiple of 16. The common
 * head sizes get their own copy, d a constant there (the tiles' loops unroll). */
void prefill_pairs(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                   const int32_t *table, int64_t total, int64_t queries, uint16_t *out,
                   int64_t num_heads, int64_t num_kv_heads, int64_t kvh, int64_t d,
                   int64_t block_size, int64_t block_stride, float scale, int64_t window,
                   float soft_cap, const float *sinks, void *scratch, int amx) {
    amx = amx && d % 32 == 0; /* tiles of 32 columns of q and k (d = 80: the dot products) */
    if (amx) configure_tiles();
    switch (d) {
        case 64: PAIRS(64); break;
        case 128: PAIRS(128); break;
        default: PAIRS(d);
    }
    if (amx) release_tiles();
}
#undef PAIRS
#else
int prefill_pairs_available(void) { return 0; }

int64_t prefill_pairs_scratch(int64_t n, int64_t d) { return 0; }

void prefill_amx_use(int on) { (void)on; }

int prefill_amx_ready(void) { return 0; }

/* Never called where prefill_pairs_available() says 0 (cpu_kernels.c's paged_prefill). */
void prefill_pairs(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                   const int32_t *table, int64_t total, int64_t queries, uint16_t *out,
                   int64_t num_heads, int64_t num_kv_heads, int64_t kvh, int64_t d,
                   int64_t block_size, int64_t block_stride, float scale, int64_t window,
                   float soft_cap, const float *sinks, void *scratch, int amx) {
    abort();
}
#endif
