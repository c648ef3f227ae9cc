/* Weight-only quantized linear layers on the CPU: out = x @ W.T + bias, W in 4 or 8 bits.
 *
 * A decode step reads every weight once, so its time is the weight bytes: a 4-bit matrix with a
 * float16 scale and min per group of 32 is 5 bits a weight (GGUF's Q4_1), an 8-bit one with a
 * float16 scale 8.5 (Q8_0), against 32 for float32 and 16 for bfloat16. Timings: the table in
 * bench/kernels_quant.py.
 *
 * Layout (engine/kernels/cpu_quant.py packs it once at load, from engine/quant/weight.py's
 * QuantizedWeight): panels of QP = 16 output columns, N padded with zero columns. Panel p is
 * one contiguous stream of K / G blocks, one per group of G weights along K (G a multiple of
 * 16); a block holds the panel's 16 columns' values of that group, then their 16 float16
 * scales, then (4 bits) their 16 float16 mins:
 *
 *   8 bits: G / 4 chunks of 64 bytes: byte 4c + i = value[c][4j + i] + 128      16 G bytes
 *   4 bits: G / 8 chunks of 64 bytes: byte 4c + i = value[c][8j + i]            8 G bytes
 *                                                  | value[c][8j + 4 + i] << 4
 *   then  scale[16] float16 (32 bytes), and for 4 bits  min[16] float16 (32 bytes)
 *
 * i.e. each 32-bit lane c of a 64-byte chunk holds four consecutive k of column c (two fours
 * for 4 bits, in its low and high nibbles): the operand of AVX512-VNNI's vpdpbusd, unsigned
 * bytes times the activations' signed ones, four products summed into each column's int32.
 * Bytes a weight: 8 + 256 / G (8.5 at G = 32) and 4 + 512 / G (5 at G = 32, 8 at 16).
 *
 * Two ways to multiply, the caller picks (cpu_quant.py: int8 wherever the kernels have it):
 * - float: each k step's 16 values masked out of their lanes in place, converted to float32
 *   and multiplied into the rows of x with FMAs, a group summed apart and then scaled:
 *   out += scale * sum_k x[k] q[k] + min * sum_k x[k]. A value masked in place is q * 2^s (s
 *   its bit offset in the lane), exact in float32, so x is read pre-scaled by 2^-s (exact
 *   too, but for |x| < 2^-102, whose products are below any output's rounding) and the
 *   products are x[k] q[k] exactly: the results differ from the dequantized
 *   matrix's float32 product only in rounding and summation order. For 8 bits the offset is
 *   the same for every k (each byte is moved to the lane's top, its sign bit flipped back) and
 *   2^-24 goes into the scale instead. GCC's vector extensions: AVX-512, AVX2 or SSE, what
 *   -march=native has.
 * - int8 (AVX2 or later): each row of x quantized per group of G to int8 (scale
 *   max|x| / 127, round to nearest even), then vpdpbusd does 64 multiply-adds an instruction
 *   where an FMA does 16: the matmul of the dequantized weights by the dequantized activations,
 *   to rounding. What llama.cpp does on every CPU (its Q8 activations). Its error is the
 *   activations' rounding, at most half a step of max|x| / 127 an element; on Gaussian data,
 *   0.5% of an output's RMS, where the weights' own rounding is 7.7% (4 bits, Q4_1's groups of
 *   32) or the same 0.5% (8 bits, Q8_0's). So 8-bit weights take their activations in two
 *   int8 planes, the rounding's residual quantized again 254 times finer (quantize_rows), each
 *   plane a row of the kernel and the two rows' totals summed: 16-bit activations, as vLLM's
 *   weight-only int8 keeps them, where one plane had doubled Q8_0's error (SmolLM2's Q8_0 file
 *   on bench/data/gpl-3.txt: -43.1 nats against float32 with one plane, -6.4 with float
 *   activations; llama.cpp -34.7). It costs twice the multiply-adds, not the weight reads:
 *   the same time at one row, 1.6x at 8 rows and 1.9x at 32 (bench/kernels_quant.py, Zen 4,
 *   2026-12-06). A row's result does not depend on the other rows
 *   (integer sums, the same float steps for each row), so a batch decodes as its rows alone.
 *   Without AVX512-VNNI (AMD Zen 2 / 3, Intel before Ice Lake, Intel's client chips) the same
 *   on 256-bit vectors, each 64-byte chunk as two 32-byte halves (columns 0-7 and 8-15, the
 *   same layout): AVX-VNNI's vpdpbusd where -march has it, else vpmaddubsw and vpmaddwd, as
 *   llama.cpp on AVX2 (int8_rows on 256 bits: how vpmaddubsw's int16 saturation is kept
 *   off). The same integer sums and float steps: the same results, bit for bit, at either
 *   width (tests/unit/engine/kernels/test_cpu_quant_avx2.py builds this file for x86-64-v3).
 * A mins term uses the activations' per-group sums (float, or int for int8), computed once a
 * row. 8-bit values are stored offset by 128 so that they are vpdpbusd's unsigned operand:
 * sum x q = sum x (q + 128) - 128 sum x.
 *
 * The 256-bit int8 path against the float one: x86-64-v3 builds (AVX2, FMA, F16C; the second
 * with -mavxvnni), run as such on this project's host (a 2-core Xeon VM with Sapphire Rapids'
 * ISA; bench/kernels_quant.py --library: SmolLM2's matrices, one thread, x float32, median of
 * 7 rounds, ms a pass), 2026-12-05, while other jobs kept the host at load 5-6 (every figure
 * 3-5x a quiet host's, the 1-row ones, bound by the shared memory, most):
 *
 *                          1 row   8 rows  32 rows
 *   q4g32 float             67.1    150.5    508.8
 *   q4g32 int8  AVX2        19.5     48.4    125.9
 *   q4g32 int8  AVX-VNNI    26.4     61.6    123.3    (its float path: 74.1, 216.2, 529.9)
 *   q8g32 float             80.9    227.0    543.5
 *   q8g32 int8  AVX2        36.3     74.4    181.0
 *   q8g32 int8  AVX-VNNI    40.1     71.5    123.5    (its float path: 94.5, 236.8, 571.4)
 *
 * Over two such runs int8 was 2.8-3.4x faster than float at one row and 3.1-4.3x from 8 rows
 * (4 bits), 1.9-2.2x and 2.2-3.1x (8 bits). Counted in CPU time instead (gate_up's and down's
 * shapes, 2-3 MB, which the load skews less): 4.0-4.4x at every row count (4 bits), 3.1-3.4x
 * (8 bits); there, from 8 rows, AVX-VNNI's int8 path is 1.2x faster than AVX2's (4 bits) and
 * 1.6-1.7x (8 bits: one vpdpbusd for vpsignb, vpmaddubsw, vpmaddwd, vpaddd), which the wall
 * times above, one build after the other, are too noisy to show; and the 512-bit build is 3-4x
 * faster than x86-64-v3's on the float path, 1.0-2.4x on the int8 path (more with more rows).
 *
 * Rows go in blocks of QROW_BLOCK (their prepared copies in the caller's scratch, from
 * quant_linear_scratch); threads split the panels (OpenMP, as panel_linear). Each block is
 * prefetched into L2 PREFETCH_AHEAD bytes before it is read: the weights are one stream (in a
 * decode step, one stream across matrices: engine/weight_arena.py), and the hardware prefetcher
 * alone kept too few lines in flight once the core was busy with the arithmetic and other
 * processes shared the memory system (SmolLM2's 4-bit matrices at one row, huge pages, a loaded
 * 2-core host: 7.6-7.8 ms a pass without, 4.4-5.0 with 64 KB ahead, 5.8-6.8 with 1-16 KB; 8
 * bits 11.2 -> 9.9). Not at one or two rows where the host streams faster without
 * (cpu_prefetch.h, picked by timing both at load). A decode step
 * (cpu_decode_step.c) can call quant_linear per matrix with its float32 staging buffer as `out`
 * and one scratch of quant_linear_scratch(max rows, max K, min G) bytes.
 */
#include <stdlib.h>

#include "cpu_dtypes.h"
#include "cpu_prefetch.h"
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vector types on hosts without AVX-512 */
/* The FMA chains as written: reassociated, GCC split them into multiplies and adds. */
#pragma GCC optimize("no-associative-math")

#define ALWAYS_INLINE static inline __attribute__((always_inline))
enum { QP = 16, QROW_BLOCK = 48 };

/* Rows of x that share each weight load: their float accumulators (two vectors a row: the
 * group's sum and the total) must fit the vector registers (32 zmm; 16 ymm, 2 a vector). With
 * fewer rows, a row's k steps alternate between up to CHAINS / rows group sums, so that CHAINS
 * independent chains of FMAs hide their latency. */
#ifdef __AVX512F__
enum { FMR = 8, CHAINS = 8 };
#elif defined(__AVX2__)
enum { FMR = 3, CHAINS = 4 };
#else
enum { FMR = 2, CHAINS = 2 };
#endif

/* The int8 path, where the ISA has it: on 512-bit vectors (vpdpbusd), else on 256-bit ones
 * (vpmaddubsw and vpmaddwd, or AVX-VNNI's vpdpbusd); IMR rows share each weight load (256
 * bits: 4 rows were 5-10% faster than 2 or 3 from 8 rows, though GCC keeps some of their
 * accumulators on the stack). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_ZMM 1
enum { IMR = 8 };
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8_YMM 1
enum { IMR = 4 };
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline int64_t value_bytes(int bits, int64_t G) { return bits == 4 ? 8 * G : 16 * G; }
static inline int64_t block_bytes(int bits, int64_t G) {
    return value_bytes(bits, G) + (bits == 4 ? 64 : 32);
}

ALWAYS_INLINE v16f splat16(float s) { return (v16f){} + s; }

/* A block's lines PREFETCH_AHEAD bytes ahead, into L2 (prefetcht2; a prefetch never faults, past
 * the end of the weights included). */
enum { PREFETCH_AHEAD = 64 << 10 };
ALWAYS_INLINE void prefetch_ahead(const uint8_t *block, int64_t bbytes) {
    for (int64_t at = 0; at < bbytes; at += 64) __builtin_prefetch(block + PREFETCH_AHEAD + at, 0, 1);
}

ALWAYS_INLINE v16u load16u(const uint8_t *p) {
    v16u v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 16 float16 values at p as float32. */
ALWAYS_INLINE v16f load_half16(const uint8_t *p) {
    v16f v;
#ifdef __AVX512F__
    __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&v, &w, sizeof v);
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + 32, &hi, sizeof hi);
#else
    for (int c = 0; c < QP; c++) {
        uint16_t h;
        memcpy(&h, p + 2 * c, sizeof h);
        v[c] = half_to_float(h);
    }
#endif
    return v;
}

/* 4 bits: k step t (0..7) of a chunk sits at bit s = 8 (t % 4) + 4 (t / 4) of each lane; the
 * one at bit 28 is shifted down instead (masked, it would overflow a signed int32). */
static inline int nibble_shift(int t) { return t == 7 ? 0 : 8 * (t % 4) + 4 * (t / 4); }

ALWAYS_INLINE v16f nibble(v16u v, const int t) {
    v16u q = t == 7 ? v >> 28 : v & (0xfu << nibble_shift(t));
    return __builtin_convertvector((v16i)q, v16f);
}

/* 8 bits: byte i of each lane moved to the top, its offset of 128 undone: value * 2^24. */
ALWAYS_INLINE v16f byte_top(v16u v, const int i) {
    v16u q = ((v << (24 - 8 * i)) & 0xff000000u) ^ 0x80000000u;
    return __builtin_convertvector((v16i)q, v16f);
}

static void store_rows(const v16f *total, int rows, float *out, int64_t N, int64_t ncols,
                       const float *bias) {
    for (int r = 0; r < rows; r++) {
        float row[QP];
        memcpy(row, &total[r], sizeof row);
        for (int64_t c = 0; c < ncols; c++)
            out[r * N + c] = row[c] + (bias != NULL ? bias[c] : 0.0f);
    }
}

/* The int8 path's totals into out: with two planes (8-bit weights), prepared rows 2i and
 * 2i + 1 are row i's two parts (quantize_rows), summed here. */
static void store_planes(const v16f *total, int rows, const int planes, float *out, int64_t N,
                         int64_t ncols, const float *bias) {
    v16f sums[QROW_BLOCK / 2];
    if (planes == 1) {
        store_rows(total, rows, out, N, ncols, bias);
        return;
    }
    for (int r = 0; r < rows / 2; r++) sums[r] = total[2 * r] + total[2 * r + 1];
    store_rows(sums, rows / 2, out, N, ncols, bias);
}

/* rows (a constant after inlining) rows of prepared x times one panel: 16 columns of out. xs:
 * the rows' x, scaled per k as `nibble` needs (4 bits); xsum: their per-group sums (4 bits).
 * With fewer rows than CHAINS, k steps alternate between `split` group sums a row. */
ALWAYS_INLINE void float_rows(const float *restrict xs, const float *restrict xsum, int64_t K,
                              int64_t ng, const uint8_t *panel, const int bits, int64_t G,
                              float *restrict out, int64_t N, int64_t ncols, const float *bias,
                              const int rows, const int prefetch) {
    const int split = rows * 8 <= CHAINS ? 8 : rows * 4 <= CHAINS ? 4 : rows * 2 <= CHAINS ? 2 : 1;
    const int64_t vbytes = value_bytes(bits, G), bbytes = block_bytes(bits, G);
    v16f total[FMR];
    for (int r = 0; r < rows; r++) total[r] = splat16(0.0f);
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *block = panel + g * bbytes;
        const float *xg = xs + g * G;
        if (prefetch) prefetch_ahead(block, bbytes);
        v16f acc[8][FMR];
        for (int s = 0; s < split; s++)
            for (int r = 0; r < rows; r++) acc[s][r] = splat16(0.0f);
        if (bits == 4) {
            for (int64_t j = 0; j < G / 8; j++) {
                v16u v = load16u(block + 64 * j);
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    v16f w = nibble(v, t);
                    for (int r = 0; r < rows; r++)
                        acc[t % split][r] += w * splat16(xg[r * K + 8 * j + t]);
                }
            }
        } else {
            for (int64_t j = 0; j < G / 4; j += 2) { /* two chunks: 8 k steps, as 4 bits */
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    v16f w = byte_top(load16u(block + 64 * j + 64 * (t / 4)), t % 4);
                    for (int r = 0; r < rows; r++)
                        acc[t % split][r] += w * splat16(xg[r * K + 4 * j + t]);
                }
            }
        }
        v16f scale = load_half16(block + vbytes);
        if (bits == 8) scale *= splat16(0x1p-24f); /* byte_top's 2^24 */
        for (int r = 0; r < rows; r++) {
            v16f a = acc[0][r];
            for (int s = 1; s < split; s++) a += acc[s][r];
            total[r] += scale * a;
        }
        if (bits == 4) {
            v16f mins = load_half16(block + vbytes + 32);
            for (int r = 0; r < rows; r++) total[r] += mins * splat16(xsum[r * ng + g]);
        }
    }
    store_rows(total, rows, out, N, ncols, bias);
}

/* 16 values of x from element `at`, as float32 (bfloat16 is a float32's high half). */
ALWAYS_INLINE v16f load_x16(const void *x, int64_t at, const int dtype) {
    v16f v;
    if (dtype == F32) {
        memcpy(&v, (const float *)x + at, sizeof v);
    } else {
        typedef uint16_t v16h __attribute__((vector_size(32)));
        v16h h;
        memcpy(&h, (const uint16_t *)x + at, sizeof h);
        v16u bits = __builtin_convertvector(h, v16u) << 16;
        memcpy(&v, &bits, sizeof v);
    }
    return v;
}

static float sum16(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < QP; i++) s += v[i];
    return s;
}

/* x rows as float_rows reads them: xs (rows, K) scaled per k (4 bits: by 2^-nibble_shift),
 * xsum (rows, ng) their groups' sums (4 bits). */
ALWAYS_INLINE void prepare_rows(const void *x, const int dtype, int64_t rows, int64_t K,
                                int bits, int64_t G, float *xs, float *xsum) {
    v16f factor;
    for (int i = 0; i < QP; i++) factor[i] = bits == 4 ? ldexpf(1.0f, -nibble_shift(i % 8)) : 1.0f;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < K / G; g++) {
            v16f sum = splat16(0.0f);
            for (int64_t k = g * G; k < (g + 1) * G; k += QP) {
                v16f v = load_x16(x, r * K + k, dtype);
                sum += v;
                v *= factor;
                memcpy(xs + r * K + k, &v, sizeof v);
            }
            if (bits == 4) xsum[r * (K / G) + g] = sum16(sum);
        }
    }
}

static void prepare_float(const void *x, int dtype, int64_t rows, int64_t K, int bits, int64_t G,
                          float *xs, float *xsum) {
    if (dtype == F32)
        prepare_rows(x, F32, rows, K, bits, G, xs, xsum);
    else
        prepare_rows(x, BF16, rows, K, bits, G, xs, xsum);
}

#define FLOAT_ROWS(r) float_rows(xs, xsum, K, ng, panel, bits, G, o, N, ncols, b, r, prefetch)
#define INT8_ROWS(r) \
    int8_rows(xq, dx, dsum, off, K, ng, panel, bits, G, o, N, ncols, b, r, prefetch)

/* Rows 0 .. rows - 1 of the prepared block times panel p, on the calling thread. */
ALWAYS_INLINE void float_panel(const float *xs, const float *xsum, const uint8_t *packed,
                               const int bits, int64_t G, const float *bias, float *out,
                               int64_t rows, int64_t N, int64_t K, int64_t p, int prefetch) {
    int64_t ng = K / G, n = p * QP, ncols = N - n < QP ? N - n : QP;
    const uint8_t *panel = packed + p * ng * block_bytes(bits, G);
    const float *b = bias != NULL ? bias + n : NULL;
    int64_t m = 0;
    float *o = out + n;
    for (; m + FMR <= rows; m += FMR, o += FMR * N, xs += FMR * K, xsum += FMR * ng)
        FLOAT_ROWS(FMR);
    switch (rows - m) {
#ifdef __AVX512F__
        case 7: FLOAT_ROWS(7); break;
        case 6: FLOAT_ROWS(6); break;
        case 5: FLOAT_ROWS(5); break;
        case 4: FLOAT_ROWS(4); break;
        case 3: FLOAT_ROWS(3); break;
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
        case 2: FLOAT_ROWS(2); break;
#endif
        case 1: FLOAT_ROWS(1); break;
        default: break;
    }
}

#if defined(INT8_ZMM) || defined(INT8_YMM)
int quant_int8_available(void) { return 1; }
#else
int quant_int8_available(void) { return 0; }
#endif

#ifdef INT8_ZMM
/* Each byte's high nibble, as a byte: one affine transform over GF(2) (byte b -> b >> 4: output
 * bit i is input bit i + 4, the matrix's byte 7 - i its row) where the CPU has GFNI, else a
 * shift and a mask. One instruction fewer a 64-byte chunk: on the Zen 4 VM, SmolLM2's 4-bit
 * matrices at one row in cache 3-5% faster (a 0.35 MB one 33.3 -> 34.7 GB/s, 1.1 MB 50.0 ->
 * 52.7), streamed from memory the same (all 30 layers' 66 MB, 23.4 -> 23.8 GB/s); the same
 * bits. */
ALWAYS_INLINE __m512i high_nibbles(__m512i v, __m512i low) {
#if defined(__GFNI__) && !defined(NO_GFNI_NIBBLES)
    (void)low;
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#endif
}

/* Four int8 activations as one int32 in every lane. */
ALWAYS_INLINE __m512i broadcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, sizeof four);
    return _mm512_set1_epi32(four);
}

/* As float_rows, on int8 activations: xq (rows, K) and per row and group (rows, ng) their
 * scale dx, dx times their sum (dsum) and 128 times their sum (off), from prepare_int8. vpdpbusd sums four products of a lane's bytes into its int32; a group's int32
 * sums (|sum| <= 127 * 255 * G) are scaled into float32 at its end. The rows' accumulators are
 * named variables (EACH_ROW), not an array: GCC 12 copied an array's vectors through other
 * registers around every vpdpbusd, as it did named ones that started from one zero. */
#define EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
ALWAYS_INLINE void int8_rows(const int8_t *restrict xq, const float *restrict dx,
                             const float *restrict dsum, const int32_t *restrict off, int64_t K,
                             int64_t ng,
                             const uint8_t *panel, const int bits, int64_t G,
                             float *restrict out, int64_t N, int64_t ncols, const float *bias,
                             const int rows, const int prefetch) {
    const int64_t vbytes = value_bytes(bits, G), bbytes = block_bytes(bits, G);
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int chains = rows <= 2 ? 2 : 1; /* few rows: a second chain a row, for the latency */
#define DECLARE(r) __m512 total##r = _mm512_setzero_ps(); __m512i acc##r, odd##r;
    EACH_ROW(DECLARE)
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *block = panel + g * bbytes;
        const int8_t *xg = xq + g * G;
        if (prefetch) prefetch_ahead(block, bbytes);
#define ZERO(r)                                                                         \
    acc##r = odd##r = _mm512_setzero_si512();                                           \
    __asm__("" : "+v"(acc##r), "+v"(odd##r));
        EACH_ROW(ZERO) /* each its own zero (else GCC copied them from one around each vpdpbusd) */
        if (bits == 4) {
            for (int64_t j = 0; j < G / 8; j++) {
                __m512i v = _mm512_loadu_si512(block + 64 * j);
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = high_nibbles(v, low);
#define DOT4(r)                                                                         \
    if (r < rows) {                                                                     \
        acc##r = _mm512_dpbusd_epi32(acc##r, lo, broadcast4(xg + r * K + 8 * j));       \
        __m512i *second = chains == 2 ? &odd##r : &acc##r;                              \
        *second = _mm512_dpbusd_epi32(*second, hi, broadcast4(xg + r * K + 8 * j + 4));  \
    }
                EACH_ROW(DOT4)
            }
        } else {
            for (int64_t j = 0; j < G / 4; j += 2) {
                __m512i v = _mm512_loadu_si512(block + 64 * j);
                __m512i w = _mm512_loadu_si512(block + 64 * j + 64);
#define DOT8(r)                                                                         \
    if (r < rows) {                                                                     \
        acc##r = _mm512_dpbusd_epi32(acc##r, v, broadcast4(xg + r * K + 4 * j));        \
        __m512i *second = chains == 2 ? &odd##r : &acc##r;                              \
        *second = _mm512_dpbusd_epi32(*second, w, broadcast4(xg + r * K + 4 * j + 4));  \
    }
                EACH_ROW(DOT8)
            }
        }
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + vbytes)));
        __m512 mins = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                      (const __m256i *)(block + vbytes + 32)))
                                : _mm512_setzero_ps();
        /* total += d scale sum(xq q) (+ d sum(xq) min, 4 bits), 8 bits' offset taken off first */
#define SCALE(r)                                                                          \
    if (r < rows) {                                                                       \
        if (chains == 2) acc##r = _mm512_add_epi32(acc##r, odd##r);                       \
        if (bits == 8) acc##r = _mm512_sub_epi32(acc##r, _mm512_set1_epi32(off[r * ng + g])); \
        __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(dx[r * ng + g]));                 \
        total##r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc##r), ds, total##r);             \
        if (bits == 4)                                                                    \
            total##r = _mm512_fmadd_ps(mins, _mm512_set1_ps(dsum[r * ng + g]), total##r); \
    }
        EACH_ROW(SCALE)
    }
    v16f t[IMR];
#define KEEP(r) memcpy(&t[r], &total##r, sizeof t[r]);
    EACH_ROW(KEEP)
    store_planes(t, rows, bits == 8 ? 2 : 1, out, N, ncols, bias);
#undef DECLARE
#undef ZERO
#undef DOT4
#undef DOT8
#undef SCALE
#undef KEEP
}
#endif

#ifdef INT8_YMM
/* Four int8 activations as one int32 in every lane. */
ALWAYS_INLINE __m256i broadcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, sizeof four);
    return _mm256_set1_epi32(four);
}

/* acc's int32 lanes plus the products of their four bytes of u (unsigned) and x (signed):
 * AVX-VNNI's vpdpbusd, or vpmaddubsw (pair sums, saturated to int16: the caller keeps them
 * within range) widened and summed by vpmaddwd. */
ALWAYS_INLINE __m256i dot4(__m256i acc, __m256i u, __m256i x) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* The int8 path on 256-bit vectors, int8_rows above in two halves: each 64-byte chunk is two
 * 32-byte ones, columns 0-7 (a) and 8-15 (b), in the same layout. Without AVX-VNNI, vpmaddubsw
 * multiplies: 4 bits, the low and high nibbles' pair sums (each at most 2 * 15 * 127) added in
 * int16 before one vpmaddwd; 8 bits, whose offset values would saturate it (2 * 255 * 127),
 * as llama.cpp does: the signed value q = byte ^ 0x80, |q| times x with q's sign (pair sums
 * within 2 * 128 * 127), so that the sum is sum(xq q) itself, no offset to take off. The same
 * integer sums as vpdpbusd's, the same float steps after: the same results as the 512-bit
 * path, bit for bit. Neither 4 chunks' nibble sums kept in int16 before one vpmaddwd nor a
 * group's halves in turn (fewer live registers) was faster on this project's host. */
#define EACH_ROW(X) X(0) X(1) X(2) X(3)
ALWAYS_INLINE void int8_rows(const int8_t *restrict xq, const float *restrict dx,
                             const float *restrict dsum, const int32_t *restrict off, int64_t K,
                             int64_t ng, const uint8_t *panel, const int bits, int64_t G,
                             float *restrict out, int64_t N, int64_t ncols, const float *bias,
                             const int rows, const int prefetch) {
    const int64_t vbytes = value_bytes(bits, G), bbytes = block_bytes(bits, G);
    const __m256i low = _mm256_set1_epi8(0x0f);
#ifdef __AVXVNNI__
    const int chains = rows <= 2 ? 2 : 1; /* few rows: a second chain a row, for the latency */
#else
    const int chains = 1; /* a chain of vpaddd: one cycle a step */
#endif
#define DECLARE(r)                                                                      \
    __m256 ta##r = _mm256_setzero_ps(), tb##r = _mm256_setzero_ps();                    \
    __m256i a##r, b##r, a2##r, b2##r;
    EACH_ROW(DECLARE)
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *block = panel + g * bbytes;
        const int8_t *xg = xq + g * G;
        if (prefetch) prefetch_ahead(block, bbytes);
#define ZERO(r)                                                                         \
    a##r = b##r = a2##r = b2##r = _mm256_setzero_si256();                               \
    __asm__("" : "+x"(a##r), "+x"(b##r), "+x"(a2##r), "+x"(b2##r));
        EACH_ROW(ZERO)
        if (bits == 4) {
            for (int64_t j = 0; j < G / 8; j++) {
                __m256i va = _mm256_loadu_si256((const __m256i *)(block + 64 * j));
                __m256i vb = _mm256_loadu_si256((const __m256i *)(block + 64 * j + 32));
                __m256i la = _mm256_and_si256(va, low), lb = _mm256_and_si256(vb, low);
                __m256i ha = _mm256_and_si256(_mm256_srli_epi16(va, 4), low);
                __m256i hb = _mm256_and_si256(_mm256_srli_epi16(vb, 4), low);
#ifdef __AVXVNNI__
#define NIBBLES(acc, odd, lo, hi, xl, xh)                                               \
    acc = dot4(acc, lo, xl);                                                            \
    if (chains == 2) odd = dot4(odd, hi, xh); else acc = dot4(acc, hi, xh);
#else
#define NIBBLES(acc, odd, lo, hi, xl, xh)                                               \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(                                      \
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)),   \
        _mm256_set1_epi16(1)));
#endif
#define DOT4(r)                                                                         \
    if (r < rows) {                                                                     \
        __m256i xl = broadcast4(xg + r * K + 8 * j), xh = broadcast4(xg + r * K + 8 * j + 4); \
        NIBBLES(a##r, a2##r, la, ha, xl, xh)                                            \
        NIBBLES(b##r, b2##r, lb, hb, xl, xh)                                            \
    }
                EACH_ROW(DOT4)
            }
        } else {
            for (int64_t j = 0; j < G / 4; j += 2) {
                const uint8_t *c = block + 64 * j;
                __m256i va = _mm256_loadu_si256((const __m256i *)c);
                __m256i vb = _mm256_loadu_si256((const __m256i *)(c + 32));
                __m256i wa = _mm256_loadu_si256((const __m256i *)(c + 64));
                __m256i wb = _mm256_loadu_si256((const __m256i *)(c + 96));
#ifdef __AVXVNNI__
#define BYTES(acc, odd, v, w, x1, x2)                                                   \
    acc = dot4(acc, v, x1);                                                             \
    if (chains == 2) odd = dot4(odd, w, x2); else acc = dot4(acc, w, x2);
#else
                const __m256i flip = _mm256_set1_epi8(-128);
                va = _mm256_xor_si256(va, flip), vb = _mm256_xor_si256(vb, flip);
                wa = _mm256_xor_si256(wa, flip), wb = _mm256_xor_si256(wb, flip);
                __m256i mva = _mm256_abs_epi8(va), mvb = _mm256_abs_epi8(vb);
                __m256i mwa = _mm256_abs_epi8(wa), mwb = _mm256_abs_epi8(wb);
#define BYTES(acc, odd, v, w, x1, x2)                                                   \
    acc = dot4(acc, m##v, _mm256_sign_epi8(x1, v));                                     \
    acc = dot4(acc, m##w, _mm256_sign_epi8(x2, w));
#endif
#define DOT8(r)                                                                         \
    if (r < rows) {                                                                     \
        __m256i x1 = broadcast4(xg + r * K + 4 * j), x2 = broadcast4(xg + r * K + 4 * j + 4); \
        BYTES(a##r, a2##r, va, wa, x1, x2)                                              \
        BYTES(b##r, b2##r, vb, wb, x1, x2)                                              \
    }
                EACH_ROW(DOT8)
            }
        }
        const uint8_t *halves = block + vbytes; /* scales, then (4 bits) mins */
        __m256 sa = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)halves));
        __m256 sb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 16)));
        __m256 ma = bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 32)))
                              : _mm256_setzero_ps();
        __m256 mb = bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + 48)))
                              : _mm256_setzero_ps();
#ifdef __AVXVNNI__
        const int offset = bits == 8; /* vpdpbusd multiplied the stored bytes, q + 128 */
#else
        const int offset = 0;
#endif
#define SCALE(r)                                                                        \
    if (r < rows) {                                                                     \
        if (chains == 2) a##r = _mm256_add_epi32(a##r, a2##r), b##r = _mm256_add_epi32(b##r, b2##r); \
        if (offset) {                                                                   \
            __m256i o = _mm256_set1_epi32(off[r * ng + g]);                             \
            a##r = _mm256_sub_epi32(a##r, o), b##r = _mm256_sub_epi32(b##r, o);         \
        }                                                                               \
        __m256 d = _mm256_set1_ps(dx[r * ng + g]);                                      \
        ta##r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##r), _mm256_mul_ps(sa, d), ta##r); \
        tb##r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b##r), _mm256_mul_ps(sb, d), tb##r); \
        if (bits == 4) {                                                                \
            __m256 s = _mm256_set1_ps(dsum[r * ng + g]);                                \
            ta##r = _mm256_fmadd_ps(ma, s, ta##r), tb##r = _mm256_fmadd_ps(mb, s, tb##r); \
        }                                                                               \
    }
        EACH_ROW(SCALE)
    }
    v16f t[IMR];
#define KEEP(r)                                                                         \
    if (r < rows) {                                                                     \
        memcpy(&t[r], &ta##r, sizeof ta##r);                                            \
        memcpy((char *)&t[r] + sizeof ta##r, &tb##r, sizeof tb##r);                     \
    }
    EACH_ROW(KEEP)
    store_planes(t, rows, bits == 8 ? 2 : 1, out, N, ncols, bias);
#undef DECLARE
#undef ZERO
#undef NIBBLES
#undef DOT4
#undef BYTES
#undef DOT8
#undef SCALE
#undef KEEP
}
#endif

#if defined(INT8_ZMM) || defined(INT8_YMM)
ALWAYS_INLINE void int8_panel(const int8_t *xq, const float *dx, const float *dsum,
                              const int32_t *off,
                              const uint8_t *packed, const int bits, int64_t G,
                              const float *bias, float *out, int64_t rows, int64_t N, int64_t K,
                              int64_t p, int prefetch) {
    int64_t ng = K / G, n = p * QP, ncols = N - n < QP ? N - n : QP;
    const uint8_t *panel = packed + p * ng * block_bytes(bits, G);
    const float *b = bias != NULL ? bias + n : NULL;
    int64_t m = 0;
    float *o = out + n;
    for (; m + IMR <= rows; m += IMR, o += IMR / (bits == 8 ? 2 : 1) * N) {
        INT8_ROWS(IMR);
        xq += IMR * K, dx += IMR * ng, dsum += IMR * ng, off += IMR * ng;
    }
    switch (rows - m) { /* the last rows - m < IMR, one unrolled copy a count */
#ifdef INT8_ZMM
        case 7: INT8_ROWS(7); break;
        case 6: INT8_ROWS(6); break;
        case 5: INT8_ROWS(5); break;
        case 4: INT8_ROWS(4); break;
#endif
        case 3: INT8_ROWS(3); break;
        case 2: INT8_ROWS(2); break;
        case 1: INT8_ROWS(1); break;
        default: break;
    }
}

/* max(amax, |v|) lane by lane. */
ALWAYS_INLINE v16f abs_max16(v16f amax, v16f v) {
#ifdef INT8_ZMM
    __m512 m, w;
    memcpy(&m, &amax, sizeof m);
    memcpy(&w, &v, sizeof w);
    m = _mm512_max_ps(m, _mm512_abs_ps(w));
    memcpy(&amax, &m, sizeof m);
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int h = 0; h < 2; h++) {
        __m256 m, w;
        memcpy(&m, (char *)&amax + 32 * h, sizeof m);
        memcpy(&w, (char *)&v + 32 * h, sizeof w);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, w));
        memcpy((char *)&amax + 32 * h, &m, sizeof m);
    }
#endif
    return amax;
}

/* The largest lane of v (v >= 0, no NaN), the sum of q's, whether any lane of u is set: vector
 * reductions (lane by lane in C, they cost the int8 path 3-7% at 8-32 rows). */
ALWAYS_INLINE float max16(v16f v) {
#ifdef INT8_ZMM
    __m512 w;
    memcpy(&w, &v, sizeof w);
    return _mm512_reduce_max_ps(w);
#else
    __m256 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (char *)&v + 32, sizeof hi);
    __m256 m8 = _mm256_max_ps(lo, hi);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
}

ALWAYS_INLINE int32_t isum16(v16i q) {
#ifdef INT8_ZMM
    __m512i w;
    memcpy(&w, &q, sizeof w);
    return _mm512_reduce_add_epi32(w);
#else
    __m256i lo, hi;
    memcpy(&lo, &q, sizeof lo);
    memcpy(&hi, (char *)&q + 32, sizeof hi);
    __m256i s8 = _mm256_add_epi32(lo, hi);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
#endif
}

ALWAYS_INLINE int any16(v16i u) {
    __m256i lo, hi;
    memcpy(&lo, &u, sizeof lo);
    memcpy(&hi, (char *)&u + 32, sizeof hi);
    __m256i both = _mm256_or_si256(lo, hi);
    return !_mm256_testz_si256(both, both);
}

/* v rounded to the nearest integer (ties to even: the MXCSR's mode) as int32, and its int8s
 * stored at out (|v| <= 127.5: in range). */
ALWAYS_INLINE v16i round16(v16f v, int8_t *out) {
    v16i q;
#ifdef INT8_ZMM
    __m512 w;
    memcpy(&w, &v, sizeof w);
    __m512i r = _mm512_cvtps_epi32(w);
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(r));
    memcpy(&q, &r, sizeof q);
#else
    __m256 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (char *)&v + 32, sizeof hi);
    __m256i a = _mm256_cvtps_epi32(lo), b = _mm256_cvtps_epi32(hi);
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8); /* a's, then b's */
    __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words),
                                    _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128((__m128i *)out, bytes);
    memcpy(&q, &a, sizeof a);
    memcpy((char *)&q + 32, &b, sizeof b);
#endif
    return q;
}

/* Each row's groups as int8: xq = round(x / d) with d = max|x| / 127 (round half to even,
 * computed as x * (127 / max|x|)); d in dx, d sum(xq) in dsum, 128 sum(xq) in off. The same
 * float steps on either vector width: the same xq. With two planes (8-bit weights), row r of x
 * becomes prepared rows 2r, that xq, and 2r + 1, its residual x / d - xq (at most half a step)
 * as lo = round(254 (x / d - xq)) with scale d / 254: x = d (xq + lo / 254) to within d / 508,
 * 16 bits' worth. |lo| <= 127, as vpsignb's path needs. */
ALWAYS_INLINE void quantize_rows(const void *x, const int dtype, int64_t rows, int64_t K,
                                 int64_t G, const int planes, int8_t *xq, float *dx, float *dsum,
                                 int32_t *off) {
    int64_t ng = K / G;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < ng; g++) {
            int64_t at = r * K + g * G, hi = planes * r * K + g * G, lo = hi + K;
            int64_t s = planes * r * ng + g;
            v16f amax = splat16(0.0f);
            v16i nan = {};
            for (int64_t k = 0; k < G; k += QP) {
                v16f v = load_x16(x, at + k, dtype);
                amax = abs_max16(amax, v);
                nan |= v != v;
            }
            float m = any16(nan) ? NAN : max16(amax); /* NaN out, as the float path */
            /* 127 / m overflows where m < 127 / FLT_MAX (~4e-37): such a group counts as
             * zeros, as one of zeros does, rather than x times infinity */
            float factor = m > 0.0f ? 127.0f / m : 0.0f;
            v16f inv = splat16(factor <= 0x1.fffffep127f ? factor : 0.0f);
            v16i sum = {}, lo_sum = {};
            for (int64_t k = 0; k < G; k += QP) {
                v16f scaled = load_x16(x, at + k, dtype) * inv;
                v16i q = round16(scaled, xq + hi + k);
                sum += q;
                if (planes == 2) /* scaled - q is exact: q is scaled's nearest integer */
                    lo_sum += round16((scaled - __builtin_convertvector(q, v16f)) * 254.0f,
                                      xq + lo + k);
            }
            dx[s] = m / 127.0f;
            dsum[s] = dx[s] * (float)isum16(sum);
            off[s] = 128 * isum16(sum);
            if (planes == 2) {
                dx[s + ng] = dx[s] / 254.0f;
                dsum[s + ng] = dx[s + ng] * (float)isum16(lo_sum);
                off[s + ng] = 128 * isum16(lo_sum);
            }
        }
    }
}

static void prepare_int8(const void *x, int dtype, int64_t rows, int64_t K, int64_t G, int planes,
                         int8_t *xq, float *dx, float *dsum, int32_t *off) {
    if (dtype == F32 && planes == 2)
        quantize_rows(x, F32, rows, K, G, 2, xq, dx, dsum, off);
    else if (dtype == F32)
        quantize_rows(x, F32, rows, K, G, 1, xq, dx, dsum, off);
    else if (planes == 2)
        quantize_rows(x, BF16, rows, K, G, 2, xq, dx, dsum, off);
    else
        quantize_rows(x, BF16, rows, K, G, 1, xq, dx, dsum, off);
}
#endif

/* Bytes of scratch quant_linear needs for M rows of K (either way of multiplying). */
int64_t quant_linear_scratch(int64_t M, int64_t K, int64_t G) {
    int64_t rows = M < QROW_BLOCK ? M : QROW_BLOCK;
    return rows * (K * (int64_t)sizeof(float) + (K / G) * 12) + 64;
}

/* out (M, N) float32 = x (M, K) @ W.T + bias. x: float32 or bfloat16 (dtype F32 / BF16);
 * packed: W as the header's layout, bits 4 or 8, G the group size (a multiple of 16 dividing
 * K); bias (N,) float32 or NULL; int8: quantize the activations (AVX2 or later); scratch:
 * quant_linear_scratch(M, K, G) bytes. Returns 0; -1 where int8 is asked for of a build
 * without it (quant_int8_available); -2 for a layout it does not take. */
int quant_linear(const void *x, int dtype, const uint8_t *packed, int bits, int64_t G,
                 const float *bias, float *out, int64_t M, int64_t N, int64_t K, int int8,
                 void *scratch, int threads) {
    if ((bits != 4 && bits != 8) || G <= 0 || G % 16 != 0 || K % G != 0) return -2;
#if !(defined(INT8_ZMM) || defined(INT8_YMM))
    if (int8) return -1;
#endif
    /* 8-bit weights take int8 activations in two planes: as many prepared rows a block */
    const int planes = int8 && bits == 8 ? 2 : 1;
    const int64_t num_panels = (N + QP - 1) / QP, elem = dtype == F32 ? 4 : 2;
    const int prefetch = prefetches(planes * M);
    for (int64_t m0 = 0; m0 < M; m0 += QROW_BLOCK / planes) {
        const int64_t rows = M - m0 < QROW_BLOCK / planes ? M - m0 : QROW_BLOCK / planes;
        const void *xb = (const char *)x + m0 * K * elem;
        float *ob = out + m0 * N;
        if (!int8) {
            float *xs = scratch, *xsum = xs + rows * K;
            prepare_float(xb, dtype, rows, K, bits, G, xs, xsum);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
            for (int64_t p = 0; p < num_panels; p++) {
                if (bits == 4)
                    float_panel(xs, xsum, packed, 4, G, bias, ob, rows, N, K, p, prefetch);
                else
                    float_panel(xs, xsum, packed, 8, G, bias, ob, rows, N, K, p, prefetch);
            }
            continue;
        }
#if defined(INT8_ZMM) || defined(INT8_YMM)
        const int64_t ng = K / G;
        const int64_t prepared = planes * rows;
        float *dx = scratch, *dsum = dx + prepared * ng;
        int32_t *off = (int32_t *)(dsum + prepared * ng);
        int8_t *xq = (int8_t *)(off + prepared * ng);
        prepare_int8(xb, dtype, rows, K, G, planes, xq, dx, dsum, off);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t p = 0; p < num_panels; p++) {
            if (bits == 4)
                int8_panel(xq, dx, dsum, off, packed, 4, G, bias, ob, prepared, N, K, p, prefetch);
            else
                int8_panel(xq, dx, dsum, off, packed, 8, G, bias, ob, prepared, N, K, p, prefetch);
        }
#endif
    }
    return 0;
}

/* Reads n bytes (a multiple of 256) as a decode step reads its weights here: 64-byte vectors,
 * each line prefetched PREFETCH_AHEAD into L2 (prefetch) or left to the hardware prefetcher.
 * What bench/peers.py's bandwidth bound times, both ways (on a huge-page buffer the size of a
 * step's weights): the fastest reads of those bytes found on this project's hosts, where
 * torch's sum of a 4 KiB-paged array read 40% of it; and how the engine picks
 * prefetch_few_rows (cpu_prefetch.h), set here. Returns a checksum so the reads stay. */
int prefetch_few_rows = 1;
void set_few_rows_prefetch(int on) { prefetch_few_rows = on != 0; }

int64_t stream_read(const uint8_t *p, int64_t n, int prefetch) {
    typedef int64_t v8l __attribute__((vector_size(64)));
    v8l acc[4] = {{0}};
    for (int64_t i = 0; i + 256 <= n; i += 256) {
        if (prefetch) prefetch_ahead(p + i, 256);
        for (int j = 0; j < 4; j++) {
            v8l v;
            memcpy(&v, p + i + 64 * j, sizeof v);
            acc[j] += v;
        }
    }
    v8l all = acc[0] + acc[1] + acc[2] + acc[3];
    int64_t sum = 0;
    for (int i = 0; i < 8; i++) sum += all[i];
    return sum;
}
