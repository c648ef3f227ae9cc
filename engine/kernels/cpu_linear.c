/* The model's linear layers on the CPU: out = x @ w.T + bias with w stored in column panels.
 *
 * A decode step multiplies a few rows by every weight of the model once, so its speed is how
 * fast the weights stream from memory. oneDNN's matmul (what torch runs) reached 8.8 GB/s on
 * SmolLM2's layers at one row on this project's AVX2 hosts, where one core reads 15.7 GB/s;
 * this kernel streams them at 11-14 GB/s (numbers in linear.py). On an AVX-512 host (a core
 * reading ~27 GB/s) it streams SmolLM2's LM head at 30 GB/s at one row where oneDNN read 19.
 *
 * With two rows or more the loop does enough arithmetic per cache line that the out-of-order
 * window no longer reaches far enough ahead to keep memory busy, and the hardware prefetcher
 * alone did not: the same head at 4 / 8 rows read 14 / 11 GB/s. A software prefetch PREFETCH_K
 * k steps ahead (4 KB for float32) brought it to 22 / 17 GB/s (oneDNN: 21 / 15).
 *
 * Layout: w (N, K) is repacked once at load into panels of P = 16 output columns,
 * panels[N / P][K][P] (N padded with zero rows): panel p holds w[p*P .. p*P+15][k] for every k
 * side by side, so a panel is one contiguous stream and a k step reads 16 weights (two vectors)
 * for all the rows of x at once. Each row of x keeps two vector accumulators (16 outputs):
 * no horizontal sums, and the weights are read once per block of up to MR rows.
 *
 *   x rows  m..m+MR-1 ─┐      panel p: k=0 [w0 .. w15] k=1 [w0 .. w15] ...
 *                      └── acc[r][0..1] += broadcast(x[r][k]) * panel[k][0..15]
 *
 * Rows go in blocks of ROW_BLOCK (their x rows stay in L2 while every panel streams past);
 * threads split the panels. Elements: float32, or bfloat16 weights widened on load (x, bias
 * and out are float32; the caller converts). Written with GCC vector extensions, so it builds
 * for whatever -march=native offers (AVX2 + FMA here) without intrinsics.
 */
#include <stdlib.h>

#include "cpu_dtypes.h"
#include "cpu_prefetch.h"

/* MR rows share each weight load; their accumulators (two vectors a row) must fit the vector
 * registers: 16 on AVX2, 32 with AVX-512 (ymm16-31 under AVX512VL). */
#ifdef __AVX512VL__
enum { P = 16, MR = 12, ROW_BLOCK = 48 };
#define ACC_REGS 24
#else
enum { P = 16, MR = 6, ROW_BLOCK = 48 };
#define ACC_REGS 12
#endif
#define PREFETCH_K 64

/* A row block's last n < MR rows as one call of ROWS(r) with r a constant, so that each row
 * count gets its own fully unrolled copy of the kernel. */
#ifdef __AVX512VL__
#define LAST_ROWS(n, ROWS)                                              \
    switch (n) {                                                        \
        case 11: ROWS(11); break; case 10: ROWS(10); break;             \
        case 9: ROWS(9); break; case 8: ROWS(8); break;                 \
        case 7: ROWS(7); break; case 6: ROWS(6); break;                 \
        case 5: ROWS(5); break; case 4: ROWS(4); break;                 \
        case 3: ROWS(3); break; case 2: ROWS(2); break;                 \
        case 1: ROWS(1); break;                                         \
    }
#else
#define LAST_ROWS(n, ROWS)                                              \
    switch (n) {                                                        \
        case 5: ROWS(5); break; case 4: ROWS(4); break;                 \
        case 3: ROWS(3); break; case 2: ROWS(2); break;                 \
        case 1: ROWS(1); break;                                         \
    }
#endif

static inline void store_row(const v8f lo, const v8f hi, float *out, int64_t ncols,
                             const float *bias) {
    float row[P];
    memcpy(row, &lo, sizeof lo);
    memcpy(row + 8, &hi, sizeof hi);
    for (int64_t j = 0; j < ncols; j++) out[j] = row[j] + (bias != NULL ? bias[j] : 0.0f);
}

/* Ask for the cache line PREFETCH_K k steps past k (beyond a panel's end: the next panel's). */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *panel, int64_t k,
                                                                 const int dtype) {
    __builtin_prefetch((const char *)panel + (k + PREFETCH_K) * P * (dtype == F32 ? 4 : 2));
}

/* rows (a constant 1..MR after inlining) rows of x times one panel: out's 16 columns. With
 * few rows, even and odd k go to separate accumulators (where the registers allow), so that
 * twice the independent multiply-add chains hide their latency and the loads in flight. */
static inline __attribute__((always_inline)) void panel_rows(
    const float *restrict x, int64_t K, const void *panel, const int dtype, float *restrict out,
    int64_t N, int64_t ncols, const float *bias, const int rows) {
    const int split = 4 * rows <= ACC_REGS ? 2 : 1;
    v8f acc[2][MR][2];
    for (int s = 0; s < split; s++)
        for (int r = 0; r < rows; r++) acc[s][r][0] = acc[s][r][1] = splat(0.0f);
    int64_t k = 0;
    for (; k + split <= K; k += split) {
        for (int s = 0; s < split; s++) {
            prefetch_ahead(panel, k + s, dtype);
            v8f w0 = load8(panel, (k + s) * P, dtype), w1 = load8(panel, (k + s) * P + 8, dtype);
            for (int r = 0; r < rows; r++) {
                v8f xb = splat(x[r * K + k + s]);
                acc[s][r][0] += w0 * xb;
                acc[s][r][1] += w1 * xb;
            }
        }
    }
    for (; k < K; k++) {
        v8f w0 = load8(panel, k * P, dtype), w1 = load8(panel, k * P + 8, dtype);
        for (int r = 0; r < rows; r++) {
            v8f xb = splat(x[r * K + k]);
            acc[0][r][0] += w0 * xb;
            acc[0][r][1] += w1 * xb;
        }
    }
    for (int r = 0; r < rows; r++) {
        if (split == 2) acc[0][r][0] += acc[1][r][0], acc[0][r][1] += acc[1][r][1];
        store_row(acc[0][r][0], acc[0][r][1], out + r * N, ncols, bias);
    }
}

/* One row of x (a one-sequence decode step): even and odd k in separate accumulators, so two
 * chains of dependent multiply-adds run at once instead of waiting on each other's latency. */
static inline __attribute__((always_inline)) void panel_row(
    const float *restrict x, int64_t K, const void *panel, const int dtype, float *restrict out,
    int64_t ncols, const float *bias) {
    v8f a0 = splat(0.0f), a1 = a0, b0 = a0, b1 = a0;
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        v8f x0 = splat(x[k]), x1 = splat(x[k + 1]);
        a0 += load8(panel, k * P, dtype) * x0;
        a1 += load8(panel, k * P + 8, dtype) * x0;
        b0 += load8(panel, k * P + 16, dtype) * x1;
        b1 += load8(panel, k * P + 24, dtype) * x1;
    }
    if (k < K) {
        v8f x0 = splat(x[k]);
        a0 += load8(panel, k * P, dtype) * x0;
        a1 += load8(panel, k * P + 8, dtype) * x0;
    }
    store_row(a0 + b0, a1 + b1, out, ncols, bias);
}

static inline __attribute__((always_inline)) void one_panel(
    const float *x, const void *panels, const int dtype, const float *bias, float *out,
    int64_t m0, int64_t m_end, int64_t N, int64_t K, int64_t p) {
    const void *panel = (const char *)panels + p * K * P * (dtype == F32 ? 4 : 2);
    int64_t n = p * P, ncols = N - n < P ? N - n : P;
    const float *b = bias != NULL ? bias + n : NULL;
    if (m_end - m0 == 1) {
        panel_row(x + m0 * K, K, panel, dtype, out + m0 * N + n, ncols, b);
        return;
    }
    int64_t m = m0;
    for (; m + MR <= m_end; m += MR)
        panel_rows(x + m * K, K, panel, dtype, out + m * N + n, N, ncols, b, MR);
    const float *xm = x + m * K;
    float *om = out + m * N + n;
#define PANEL_ROWS(r) panel_rows(xm, K, panel, dtype, om, N, ncols, b, r)
    LAST_ROWS(m_end - m, PANEL_ROWS)
#undef PANEL_ROWS
}

/* Panels p_begin .. p_end - 1 (output columns 16 p_begin ..) of panel_linear's product for all M
 * rows (no row blocks: M of at most ROW_BLOCK keeps x in L2), on the calling thread: the unit
 * of work of cpu_moe.c, which splits each expert's panels between its threads itself. */
void panel_range(const float *x, const void *panels, int dtype, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; p++) {
        if (dtype == F32)
            one_panel(x, panels, F32, bias, out, 0, M, N, K, p);
        else
            one_panel(x, panels, BF16, bias, out, 0, M, N, K, p);
    }
}

/* x: (M, K) float32; panels as above, of dtype; bias: (N,) float32 or NULL; out: (M, N) float32. */
void panel_linear(const float *x, const void *panels, int dtype, const float *bias, float *out,
                  int64_t M, int64_t N, int64_t K, int threads) {
    int64_t num_panels = (N + P - 1) / P;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t m_end = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t p = 0; p < num_panels; p++) {
            if (dtype == F32)
                one_panel(x, panels, F32, bias, out, m0, m_end, N, K, p);
            else
                one_panel(x, panels, BF16, bias, out, m0, m_end, N, K, p);
        }
    }
}

/* --- AMX tiles ---------------------------------------------------------------------------
 * From a few rows on, vdpbf16ps's multiply-adds (one instruction per row for every 64 bytes of
 * weights) outrun memory no longer, and oneDNN took batches from 6-12 rows at a third to a half
 * below what a core streams (Qwen3-0.6B's layers, 16-64 rows: 7-9.5 GB/s where a core reads
 * 14-15). A panel's pairs are AMX's own B layout: 16 k steps of a panel (16 rows of 64 bytes,
 * 1 KB, contiguous) are one B tile, 16 rows of x by 32 of K an A tile (row stride 2 K bytes),
 * and one tdpbf16ps adds their product into 16 x 16 float32 sums. Up to 64 rows (4 sum tiles)
 * share each weight tile; the products, exact in float32, are summed in another order than
 * pair_rows'. Rows beyond M in the last 16 are zeros from a copy of x (a tile reads 16). */
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_LINEAR 1
#else
#define AMX_LINEAR 0
#endif
#if AMX_LINEAR
#include "cpu_amx.h"

/* sum tiles at once; fewer rows keep pair_rows: Qwen3-0.6B's C step at 2 / 4 / 8 rows took
 * 111 / 120 / 137 ms on tiles and 106 / 117 / 148 on pair_rows (bench/decode_batch.py) */
enum { AMX_BLOCKS = 4, AMX_MIN_ROWS = 8 };
#define AMX_PREFETCH 4096                  /* bytes of weights asked for ahead */

static int linear_amx_wanted = 1; /* linear_amx_use(0): the dot products on an AMX host too */

void linear_amx_use(int on) { linear_amx_wanted = on; }

int linear_amx_ready(void) { return linear_amx_wanted && amx_permitted(); }

/* x's rows m0 .. m0 + 16 blocks - 1 (zero rows past M already) times panel p: tiles 0 .. blocks
 * - 1 the sums, 4 the weights, 5 and 6 x's rows. */
static inline __attribute__((always_inline)) void amx_panel(const uint16_t *x, int64_t K,
                                                            const uint16_t *panel,
                                                            const int blocks, float *sums) {
    _tile_zero(0);
    if (blocks > 1) _tile_zero(1);
    if (blocks > 2) _tile_zero(2);
    if (blocks > 3) _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        const uint16_t *w = panel + k * P; /* 16 k steps of 2 values for 16 columns */
        for (int line = 0; line < 1024; line += 64)
            _mm_prefetch((const char *)w + AMX_PREFETCH + line, _MM_HINT_T0);
        _tile_loadd(4, w, 64);
        _tile_loadd(5, x + k, K * 2);
        _tile_dpbf16ps(0, 5, 4);
        if (blocks > 1) {
            _tile_loadd(6, x + 16 * K + k, K * 2);
            _tile_dpbf16ps(1, 6, 4);
        }
        if (blocks > 2) {
            _tile_loadd(5, x + 32 * K + k, K * 2);
            _tile_dpbf16ps(2, 5, 4);
        }
        if (blocks > 3) {
            _tile_loadd(6, x + 48 * K + k, K * 2);
            _tile_dpbf16ps(3, 6, 4);
        }
    }
    _tile_stored(0, sums, 64);
    if (blocks > 1) _tile_stored(1, sums + 256, 64);
    if (blocks > 2) _tile_stored(2, sums + 512, 64);
    if (blocks > 3) _tile_stored(3, sums + 768, 64);
}

/* Rows m0 .. m0 + m_rows - 1 of x (zero rows after them to a multiple of 16) times panel p:
 * out's columns 16 p .. 16 p + 15. */
static void amx_rows(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                     int64_t m0, int64_t m_rows, int64_t N, int64_t K, int64_t p) {
    float sums[AMX_BLOCKS * TR * P];
    const uint16_t *panel = pairs + p * K * P, *xm = x + m0 * K;
    switch ((m_rows + TR - 1) / TR) {
        case 1: amx_panel(xm, K, panel, 1, sums); break;
        case 2: amx_panel(xm, K, panel, 2, sums); break;
        case 3: amx_panel(xm, K, panel, 3, sums); break;
        default: amx_panel(xm, K, panel, 4, sums); break;
    }
    int64_t n = p * P, ncols = N - n < P ? N - n : P;
    for (int64_t r = 0; r < m_rows; r++)
        for (int64_t c = 0; c < ncols; c++)
            out[(m0 + r) * N + n + c] = sums[r * P + c] + (bias != NULL ? bias[n + c] : 0.0f);
}

/* x with its rows made a multiple of 16 (zeros after M): x itself, or a copy in this thread's
 * scratch. */
static const uint16_t *whole_tiles(const uint16_t *x, int64_t M, int64_t K) {
    int64_t rows = (M + TR - 1) / TR * TR;
    if (rows == M) return x;
    uint16_t *padded = thread_scratch(sizeof(uint16_t) * rows * K);
    if (padded == NULL) abort(); /* pair_linear has no error to return */
    memcpy(padded, x, sizeof(uint16_t) * M * K);
    memset(padded + M * K, 0, sizeof(uint16_t) * (rows - M) * K);
    return padded;
}

/* pair_linear on tiles, K a multiple of 32: up to 64 rows at a time, threads splitting the
 * panels, each thread with its own tile configuration. */
static void amx_linear(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                       int64_t M, int64_t N, int64_t K, int threads) {
    const uint16_t *rows = whole_tiles(x, M, K);
    int64_t num_panels = (N + P - 1) / P;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        configure_tiles();
        for (int64_t m0 = 0; m0 < M; m0 += AMX_BLOCKS * TR) {
            int64_t m_rows = M - m0 < AMX_BLOCKS * TR ? M - m0 : AMX_BLOCKS * TR;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++)
                amx_rows(rows, pairs, bias, out, m0, m_rows, N, K, p);
        }
        release_tiles();
    }
}
#else
int linear_amx_ready(void) { return 0; }
void linear_amx_use(int on) { (void)on; }
#endif

/* bfloat16 dot products (AVX512-BF16): x (M, K) and the weights both bfloat16, summed in
 * float32 by `vdpbf16ps`, two k at a time, 16 columns a vector. Where oneDNN has this too, its
 * matmul beat the widening panels above from five rows (twice the multiply-adds an instruction);
 * with the same instruction the C decode step keeps its lead at every batch size.
 *
 * Layout ("pairs"): panels[N / P][K / 2][P][2]: k step j of panel p holds, for each of its 16
 * columns n, (w[n][2j], w[n][2j + 1]) side by side: one 64-byte vector, one cache line. A row
 * of x is read as K / 2 such pairs, each broadcast to all 16 lanes. K must be even. Each k step
 * prefetches the line PREFETCH_K steps ahead, but at one or two rows only where the host streams
 * faster so (cpu_prefetch.h). */
#ifdef __AVX512BF16__
#include <immintrin.h>

int bf16_pairs_available(void) { return 1; }

static inline __attribute__((always_inline)) void pair_rows(
    const uint16_t *restrict x, int64_t K, const uint16_t *panel, float *restrict out, int64_t N,
    int64_t ncols, const float *bias, const int rows, const int prefetch) {
    /* few rows: up to four independent chains each, for the instruction's latency */
    const int split = rows <= 3 ? 4 : rows <= 6 ? 2 : 1;
    const int64_t K2 = K / 2;
    __m512 acc[4][MR];
    for (int s = 0; s < split; s++)
        for (int r = 0; r < rows; r++) acc[s][r] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + split <= K2; j += split) {
        for (int s = 0; s < split; s++) {
            if (prefetch)
                _mm_prefetch((const char *)(panel + (j + s + PREFETCH_K) * 2 * P), _MM_HINT_T0);
            __m512bh w = (__m512bh)_mm512_loadu_si512(panel + (j + s) * 2 * P);
            for (int r = 0; r < rows; r++) {
                uint32_t pair;
                memcpy(&pair, x + r * K + 2 * (j + s), sizeof pair);
                acc[s][r] = _mm512_dpbf16_ps(acc[s][r], w, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
    }
    for (; j < K2; j++) {
        __m512bh w = (__m512bh)_mm512_loadu_si512(panel + j * 2 * P);
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * K + 2 * j, sizeof pair);
            acc[0][r] = _mm512_dpbf16_ps(acc[0][r], w, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int s = 1; s < split; s++) acc[0][r] = _mm512_add_ps(acc[0][r], acc[s][r]);
        float row[P];
        _mm512_storeu_ps(row, acc[0][r]);
        for (int64_t c = 0; c < ncols; c++)
            out[r * N + c] = row[c] + (bias != NULL ? bias[c] : 0.0f);
    }
}

/* Rows m0 .. m_end - 1 of x times panel p: out's columns 16 p .. 16 p + 15. */
static inline void pair_panel(const uint16_t *x, const uint16_t *pairs, const float *bias,
                              float *out, int64_t m0, int64_t m_end, int64_t N, int64_t K,
                              int64_t p, int prefetch) {
    const uint16_t *panel = pairs + p * K * P;
    int64_t n = p * P, ncols = N - n < P ? N - n : P;
    const float *b = bias != NULL ? bias + n : NULL;
    int64_t m = m0;
    for (; m + MR <= m_end; m += MR)
        pair_rows(x + m * K, K, panel, out + m * N + n, N, ncols, b, MR, prefetch);
    const uint16_t *xm = x + m * K;
    float *om = out + m * N + n;
#define PAIR_ROWS(r) pair_rows(xm, K, panel, om, N, ncols, b, r, prefetch)
    LAST_ROWS(m_end - m, PAIR_ROWS)
#undef PAIR_ROWS
}

/* x: (M, K) bfloat16, K even; pairs as above; bias (N,) float32 or NULL; out (M, N) float32. */
void pair_linear(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int threads) {
#if AMX_LINEAR
    if (M >= AMX_MIN_ROWS && K % 32 == 0 && linear_amx_ready()) {
        amx_linear(x, pairs, bias, out, M, N, K, threads);
        return;
    }
#endif
    int64_t num_panels = (N + P - 1) / P;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t m_end = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t p = 0; p < num_panels; p++)
            pair_panel(x, pairs, bias, out, m0, m_end, N, K, p, prefetches(M));
    }
}

/* As panel_range, for pairs. */
void pair_range(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; p++)
        pair_panel(x, pairs, bias, out, 0, M, N, K, p, prefetches(M));
}
#else
int bf16_pairs_available(void) { return 0; }

/* Never called where bf16_pairs_available() says 0 (engine/linear.py and
 * cpu_kernels.pack_experts pack no pairs there). */
void pair_linear(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int threads) {
    (void)x, (void)pairs, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)threads;
    abort();
}

void pair_range(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end) {
    (void)x, (void)pairs, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)p_begin,
        (void)p_end;
    abort();
}
#endif
