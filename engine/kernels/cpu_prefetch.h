/* Whether a matmul of at most FEW_ROWS rows (a one- or two-sequence decode step) prefetches its
 * weights in software. With so little arithmetic a cache line, how fast the weights stream is the
 * host's memory system's, and hosts differ: on the project's Xeon VM cpu_quant.c's prefetch took
 * SmolLM2's 4-bit matrices at one row from 7.6 to 4.4 ms; on its Zen 4 VM it cost a quarter, the
 * hardware prefetcher alone being faster (3.1 ms against 4.0; stream_read 38-40 GB/s against
 * 31-32; bfloat16 pairs 10.3 ms against 11.9). From 3-4 rows the prefetch paid on both (Zen 4, 4
 * bits, 8 rows: 9.6 ms without, 8.0 with), so more rows always prefetch. At load the engine
 * times one-row products through these kernels over its weights both ways and sets the faster
 * (engine/weight_arena.py); stream_read's rates are no proxy (a tie at 27.9 / 27.6 GB/s on
 * the Zen 4 VM, while the Q4_1 step took 6.4 ms prefetched against 4.8).
 * Read by cpu_quant.c (every quantized matmul) and cpu_linear.c's bfloat16 pairs; its float32
 * panels never prefetch at one row (panel_row) and always from two, unchanged (no host measured
 * otherwise). Defined in cpu_quant.c, beside stream_read. */
#ifndef CPU_PREFETCH_H
#define CPU_PREFETCH_H

enum { FEW_ROWS = 2 };
extern int prefetch_few_rows;

/* Whether a call of `rows` rows prefetches. */
static inline int prefetches(long long rows) { return rows > FEW_ROWS || prefetch_few_rows; }

#endif
