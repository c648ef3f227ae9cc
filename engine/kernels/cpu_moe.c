/* A mixture-of-experts layer's experts on the CPU (Qwen3-MoE, Mixtral, gpt-oss), grouped by
 * expert: reference.moe_experts_ref's maths, each expert's weights streamed once per call.
 *
 * A decode step of 32 sequences, each routed to 8 of 64 experts, sends ~4 rows to each expert;
 * taken token by token, each expert's weights would stream from memory ~4 times (and 5 or 6 for
 * the popular ones), and at decode sizes the weights' bytes are the whole cost. Here the rows
 * are sorted by expert first, and each expert multiplies all of its rows at once with
 * cpu_linear.c's kernels (panels, or bfloat16 pairs for AVX512-BF16's dot products), reading
 * every weight once. The rows go back to their tokens and are summed in top_k order, as the
 * reference sums them, whatever the grouping or the thread count.
 *
 * A Qwen3-MoE-shaped layer (hidden 2048, 128 experts, top 8, moe_intermediate 768; 9.4 MB an
 * expert in bfloat16, 18.9 in float32), random routing, one thread of this project's 2-core
 * Zen 4 host (AVX512-BF16), against Hugging Face's loop over the experts hit in torch and a
 * naive loop over (token, expert) pairs, and the bytes of the experts touched at 25 GB/s:
 *
 *   tokens  experts   bfloat16 (pairs)               float32 (panels)
 *           touched   C      HF loop  naive  bound   C      HF loop  naive  bound   (ms)
 *   1       8         2.65   8.1      7.5    3.0     5.1    9.8      9.4    6.0
 *   8       48        18.2   48       62     18.1    30.6   71       77     36.2
 *   32      111       42     116      280    41.9    77     209      320    83.8
 *
 * i.e. 22-30 GB/s, what one core streams. Two threads, bfloat16, the best of ten rounds while
 * other jobs kept a core busy: 1.7 / 15.3 / 40 ms at 1 / 8 / 32 tokens (45 / 33 / 26 GB/s);
 * an idle host should do better at 8 and 32, not measured here.
 *
 * One call, a chunk of tokens at a time (all of a decode step's; a prefill's in chunks whose
 * buffers fit chunk_bytes, 64 MB from cpu_kernels.py, each chunk one more pass over the
 * experts it routes to):
 *
 *   plan     rows = the (token, k) slots sorted by expert (a counting sort)     serial
 *   gather   xs[row] = x[token of row]                                          rows split
 *   gate_up  h[e's rows] = xs[e's rows] @ gate_up[e].T + bias                    (expert, up to
 *   act      a[row] = act(gate, up), each rounded to the dtype as the reference  ROWS rows,
 *   down     y[e's rows] = a[e's rows] @ down[e].T + bias                        panels) split
 *   combine  out[t] = sum over k, in order, of w[t][k] * y[row of (t, k)]       tokens split
 *
 * The threads split each matrix's panels (ITEM_BYTES of weights a work item), so at one token
 * both cores stream halves of the same few experts; each phase ends at the loop's barrier.
 * expert_passes() counts the sweeps of an expert's weights (gate_up and down) by up to ROWS of
 * its rows: one per expert routed to, per call, at decode sizes.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_dtypes.h"

/* cpu_linear.c: panels p_begin .. p_end - 1 of x (M, K) @ w.T + bias, on the calling thread. */
void panel_range(const float *x, const void *panels, int dtype, const float *bias, float *out,
                 int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end);
void pair_range(const uint16_t *x, const uint16_t *pairs, const float *bias, float *out,
                int64_t M, int64_t N, int64_t K, int64_t p_begin, int64_t p_end);

enum { COLUMNS = 16 };  /* output columns of a panel (cpu_linear.c's P) */
enum { ROWS = 48 };     /* an expert's rows swept over its weights at once: cpu_linear.c's
                           ROW_BLOCK, x's rows held in L2 while the panels stream past */
enum { ITEM_BYTES = 256 << 10 }; /* weights of one work item: long streams, many items */
enum { ACT_SILU = 0, ACT_GPT_OSS = 1 };

static int64_t passes; /* expert weight sweeps since the library was loaded */

int64_t expert_passes(void) { return passes; }

/* Up to ROWS rows of one expert, rows row0 .. row0 + rows - 1 of the sorted order. */
typedef struct {
    int64_t expert, row0, rows;
} Sweep;

/* One matrix of every expert, as cpu_kernels.pack_experts left it: (E, N / 16, K, 16) panels,
 * or (E, N / 16, K / 2, 16, 2) pairs; bias (E, N) float32 or NULL. */
typedef struct {
    const void *weights;
    const float *bias;
    int64_t N, K, num_panels, per_item, items; /* items: work items of one sweep */
} Matrix;

static Matrix matrix(const void *weights, const float *bias, int64_t N, int64_t K, int elem) {
    Matrix m = {weights, bias, N, K, (N + COLUMNS - 1) / COLUMNS, 0, 0};
    m.per_item = ITEM_BYTES / (K * COLUMNS * elem);
    m.per_item = m.per_item < 1 ? 1 : m.per_item;
    m.items = (m.num_panels + m.per_item - 1) / m.per_item;
    return m;
}

/* Work item i of a sweep: its panels of the expert's matrix for the sweep's rows of `in`
 * (rows of K, float32 or bfloat16 for pairs) into `out` (rows of N, float32). */
static void sweep_item(const Sweep *s, const Matrix *m, int64_t i, const void *in, float *out,
                       int dtype, int pairs) {
    int64_t p_begin = i * m->per_item;
    int64_t p_end = p_begin + m->per_item < m->num_panels ? p_begin + m->per_item : m->num_panels;
    int64_t elem = dtype == F32 ? 4 : 2;
    const char *w = (const char *)m->weights + s->expert * m->num_panels * COLUMNS * m->K * elem;
    const float *bias = m->bias != NULL ? m->bias + s->expert * m->N : NULL;
    float *o = out + s->row0 * m->N;
    if (pairs)
        pair_range((const uint16_t *)in + s->row0 * m->K, (const uint16_t *)w, bias, o, s->rows,
                   m->N, m->K, p_begin, p_end);
    else
        panel_range((const float *)in + s->row0 * m->K, w, dtype, bias, o, s->rows, m->N, m->K,
                    p_begin, p_end);
}

/* The expert's activation of one (gate, up) pair, both already rounded to the dtype:
 * silu(gate) * up, or gpt-oss's clamped (up + 1) * gate * sigmoid(alpha * gate). */
static inline float expert_act(float gate, float up, int act, float alpha, float limit) {
    if (act == ACT_SILU) return silu(gate) * up;
    gate = gate > limit ? limit : gate;
    up = up > limit ? limit : up < -limit ? -limit : up;
    return (up + 1.0f) * gate * (1.0f / (1.0f + exp_clamped(-(gate * alpha))));
}

/* A chunk's buffers, carved from one allocation sized for the largest chunk (the 8-byte
 * members first, so that each stays aligned). */
typedef struct {
    int64_t *row_of_slot, *token_of_row, *counts, *next;
    Sweep *sweeps;
    float *xs, *h, *a, *y; /* rows x hidden, 2 inter, inter, hidden */
} Buffers;

static size_t buffer_bytes(int64_t rows, int64_t E, int64_t H, int64_t I) {
    return sizeof(int64_t) * (2 * rows + 2 * (E + 1)) + sizeof(Sweep) * (rows / ROWS + E + 1) +
           sizeof(float) * rows * (2 * H + 3 * I);
}

static Buffers carve(void *scratch, int64_t rows, int64_t E, int64_t H, int64_t I) {
    Buffers b;
    int64_t *n = scratch;
    b.row_of_slot = n, n += rows;
    b.token_of_row = n, n += rows;
    b.counts = n, n += E + 1;
    b.next = n, n += E + 1;
    b.sweeps = (Sweep *)n;
    float *f = (float *)(b.sweeps + rows / ROWS + E + 1);
    b.xs = f, f += rows * H;
    b.h = f, f += rows * 2 * I;
    b.a = f, f += rows * I;
    b.y = f;
    return b;
}

/* Sort the chunk's slots (tokens t0 .. t0 + slots / top_k - 1) by expert and cut each expert's
 * rows into sweeps. Returns the number of sweeps, or -1 for an expert id out of range. */
static int64_t plan(const int64_t *topk_ids, int64_t t0, int64_t slots, int64_t top_k,
                    int64_t E, Buffers *b) {
    const int64_t *ids = topk_ids + t0 * top_k;
    memset(b->counts, 0, sizeof(int64_t) * (E + 1));
    for (int64_t s = 0; s < slots; s++) {
        if (ids[s] < 0 || ids[s] >= E) return -1;
        b->counts[ids[s] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) b->counts[e + 1] += b->counts[e]; /* now each one's start */
    memcpy(b->next, b->counts, sizeof(int64_t) * (E + 1));
    for (int64_t s = 0; s < slots; s++) {
        int64_t row = b->next[ids[s]]++;
        b->row_of_slot[s] = row;
        b->token_of_row[row] = t0 + s / top_k;
    }
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t end = b->counts[e + 1];
        for (int64_t r = b->counts[e]; r < end; r += ROWS)
            b->sweeps[n++] = (Sweep){e, r, end - r < ROWS ? end - r : ROWS};
    }
    return n;
}

/* The layer's operands (see moe_experts). */
typedef struct {
    const void *x;
    const float *topk_weights;
    void *out;
    int64_t top_k, H, I;
    int activation;
    float alpha, limit;
    Matrix gate_up, down;
} Layer;

/* One chunk's phases after its plan, tokens t0 .. t0 + n - 1; dtype and pairs constants after
 * inlining, so that the per-value loops are compiled for each element type. */
static inline __attribute__((always_inline)) void run_chunk(const Layer *L, const Buffers *b,
                                                            int64_t t0, int64_t n,
                                                            int64_t num_sweeps, int threads,
                                                            const int dtype, const int pairs) {
    const int64_t H = L->H, I = L->I, top_k = L->top_k, rows = n * top_k;
    /* pairs multiply bfloat16 rows: xs and a hold them in their floats' room */
    uint16_t *xs16 = (uint16_t *)b->xs, *a16 = (uint16_t *)b->a;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int64_t src = b->token_of_row[r] * H;
            if (pairs)
                memcpy(xs16 + r * H, (const uint16_t *)L->x + src, sizeof(uint16_t) * H);
            else
                for (int64_t c = 0; c < H; c++) b->xs[r * H + c] = get(L->x, src + c, dtype);
        }
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < num_sweeps * L->gate_up.items; i++)
            sweep_item(&b->sweeps[i / L->gate_up.items], &L->gate_up, i % L->gate_up.items,
                       b->xs, b->h, dtype, pairs);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < I; j++) {
                float gate = held(b->h[r * 2 * I + j], dtype);
                float up = held(b->h[r * 2 * I + I + j], dtype);
                float act = held(expert_act(gate, up, L->activation, L->alpha, L->limit), dtype);
                if (pairs)
                    a16[r * I + j] = to_bf16(act);
                else
                    b->a[r * I + j] = act;
            }
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < num_sweeps * L->down.items; i++)
            sweep_item(&b->sweeps[i / L->down.items], &L->down, i % L->down.items, b->a, b->y,
                       dtype, pairs);
        /* each token's sum in top_k order, into the row of its first slot */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) {
            const int64_t *slot_rows = b->row_of_slot + t * top_k;
            const float *w = L->topk_weights + (t0 + t) * top_k;
            float *acc = b->y + slot_rows[0] * H;
            for (int64_t c = 0; c < H; c++) acc[c] = w[0] * held(acc[c], dtype);
            for (int64_t k = 1; k < top_k; k++) {
                const float *y = b->y + slot_rows[k] * H;
                for (int64_t c = 0; c < H; c++) acc[c] += w[k] * held(y[c], dtype);
            }
            for (int64_t c = 0; c < H; c++) put(L->out, (t0 + t) * H + c, acc[c], dtype);
        }
    }
}

/* x, out: (tokens, H) of dtype; topk_ids (tokens, top_k) int64; topk_weights (tokens, top_k)
 * float32; gate_up, down: every expert's (2 I, H) and (H, I) matrices packed (pairs: bfloat16
 * pairs, else panels of dtype), their biases float32 or NULL; activation ACT_SILU or
 * ACT_GPT_OSS (alpha, limit); chunk_bytes: the buffers' budget (at least one token's are
 * had). Returns 0, -1 when scratch memory could not be had, -2 for an expert id out of
 * range. */
int moe_experts(const void *x, const int64_t *topk_ids, const float *topk_weights,
                const void *gate_up, const void *down, const float *gate_up_bias,
                const float *down_bias, void *out, int64_t tokens, int64_t top_k, int64_t E,
                int64_t H, int64_t I, int dtype, int pairs, int activation, float alpha,
                float limit, int64_t chunk_bytes, int threads) {
    if (tokens == 0) return 0;
    int elem = dtype == F32 ? 4 : 2;
    Layer L = {x, topk_weights, out, top_k, H, I, activation, alpha, limit,
               matrix(gate_up, gate_up_bias, 2 * I, H, elem), matrix(down, down_bias, H, I, elem)};
    int64_t chunk = chunk_bytes / (top_k * (int64_t)sizeof(float) * (2 * H + 3 * I));
    chunk = chunk < 1 ? 1 : chunk > tokens ? tokens : chunk;
    void *scratch = malloc(buffer_bytes(chunk * top_k, E, H, I));
    if (scratch == NULL) return -1;
    Buffers b = carve(scratch, chunk * top_k, E, H, I);
    int status = 0;
    for (int64_t t0 = 0; t0 < tokens && status == 0; t0 += chunk) {
        int64_t n = tokens - t0 < chunk ? tokens - t0 : chunk;
        int64_t num_sweeps = plan(topk_ids, t0, n * top_k, top_k, E, &b);
        if (num_sweeps < 0) {
            status = -2;
            break;
        }
        passes += num_sweeps;
        if (dtype == F32)
            run_chunk(&L, &b, t0, n, num_sweeps, threads, F32, 0);
        else if (pairs)
            run_chunk(&L, &b, t0, n, num_sweeps, threads, BF16, 1);
        else
            run_chunk(&L, &b, t0, n, num_sweeps, threads, BF16, 0);
    }
    free(scratch);
    return status;
}
