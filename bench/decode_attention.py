"""Time the CPU decode attention (cpu_kernels.c's paged_decode) alone, as a decode step runs it.

One sequence (or a batch) over a bfloat16 pool laid out as engine/kv_cache.py lays it (every
layer's block between two of a layer's blocks, blocks in shuffled order, huge pages), float32
queries (a GGUF or float32 model's; a bfloat16 model's are the same values), one thread, every
layer once: a step's attention. The kernel is called through ctypes with its arguments built
up front, so the time is the kernel's. `gbps` is the K and V bytes over the time, beside what
one core streams (`stream_read` over as many bytes of huge pages): the cache is read once, so
that is its bound. Shapes: SmolLM2-135M (9 query / 3 KV heads of 64, 30 layers), Qwen2.5-0.5B
(14 / 2 of 64, 24), Llama-3.2-1B (32 / 8 of 64, 16) and Qwen3-0.6B (16 / 8 of 128, 28).

This project's 2-core Xeon VM (AVX-512, AMX), 2026-12-06, 7 rounds, median; before the 512-bit
path (8-lane FMAs, two instructions to widen 8 bfloat16s, a scalar max in the softmax) and
after (16 lanes, 32 values widened by two unpacks, the max on 8 lanes), one run each:

    model          context     MB   before ms  GB/s   after ms  GB/s   stream GB/s
    smollm2-135m     512    11.8       1.11  10.6       0.78  15.1    29.0
    smollm2-135m    1024    23.6       2.18  10.8       1.51  15.6    28.9
    smollm2-135m    4096    94.4      13.38   7.1      10.73   8.8    14.9
    qwen2.5-0.5b     512     6.3       1.25   5.0       0.79   7.9    29.0
    qwen2.5-0.5b    1024    12.6       2.52   5.0       1.61   7.8    29.1
    qwen2.5-0.5b    4096    50.3      11.06   4.5       7.93   6.3    24.2
    llama-3.2-1b     512    16.8       2.27   7.4       1.76   9.5    28.4
    llama-3.2-1b    1024    33.6       5.50   6.1       4.01   8.4    29.4
    llama-3.2-1b    4096   134.2      24.58   5.5      18.95   7.1    14.7
    qwen3-0.6b       512    58.7       6.53   9.0       5.90  10.0    23.4
    qwen3-0.6b      1024   117.4      13.72   8.6      12.27   9.6    15.3
    qwen3-0.6b      4096   469.8      58.48   8.0      50.44   9.3    15.0

1.1-1.6x faster. Still short of what a core streams, for two reasons the profiles show. Where
the cache fits the last-level cache (the rows whose stream reads 23-29 GB/s) the kernel is bound
by its instructions: a query head's score is a dot product of 64 or 128 values ending in a
tree of lane sums, and with Qwen2.5's 7 query heads a KV head the score pass and the softmax
alone took 0.64 of its 0.79 ms at 512. From memory (the 4k rows, 15 GB/s streamed), the reads
are 6-32 KB pieces (a block of one layer) in shuffled order, which the hardware prefetcher does
not follow from one to the next; the kernel prefetches two chunks of keys ahead, and neither a
longer distance (4 or 8 chunks) nor prefetching into L1 changed it beyond the noise, while no
software prefetch at all was 1.1-1.45x slower at 4k (at 512 the same, or 1.4x faster for
Llama's shape).

Where the time sits (perf, Qwen3's shape at 1k, 2026-12-06 later): two thirds of the kernel's
samples fall on its prefetch loops (the instruction after each `prefetcht2`), the dot products
and sums on the rest: the core waits on memory there, and it has only so many lines in
flight. Fewer prefetches, to leave the rest to the hardware's streams within a block, were
slower at every spacing: one every 128, 256, 512 or 2,048 bytes (a token's row) took Qwen3 at
1k from 13.9 ms to 20.6, 19.0, 16.7 and 14.6; prefetching the values during the keys' pass
(both streams at once) took it to 17.1. A software prefetch holds a fill buffer until its line
arrives, a dozen or two at a time, which at this host's ~100 ns is ~10 GB/s: the kernel's rate.

Since 2026-12-07 a buffer of a model's weights' size (1 GB) is read before each timed step, as
a decode step's layers read theirs: the host's 480 MB last-level cache held the smaller pools
between steps before, which no serving step sees. With that, the same host, 7 rounds, the
kernel before and after two changes (one run each, the two runs back to back):
- the prefetches of the chunk AHEAD chunks on spread a line for a line through the chunk's
  loads, where they went out as one burst per chunk (256 lines for Qwen3's shape);
- the softmax on 16 lanes, where its exp and sum were scalar.

    model          context     MB   before ms  GB/s   after ms  GB/s   stream GB/s
    smollm2-135m     512    11.8       1.60   7.4       1.54   7.6    26.1
    smollm2-135m    1024    23.6       3.17   7.4       2.75   8.6    26.5
    smollm2-135m    4096    94.4      13.11   7.2      11.61   8.1    16.6
    qwen2.5-0.5b     512     6.3       1.51   4.2       1.26   5.0    24.3
    qwen2.5-0.5b    1024    12.6       2.71   4.6       2.55   4.9    25.5
    qwen2.5-0.5b    4096    50.3       9.59   5.2       8.50   5.9    26.8
    llama-3.2-1b     512    16.8       2.92   5.8       2.34   7.2    26.8
    llama-3.2-1b    1024    33.6       5.85   5.7       4.91   6.8    27.4
    llama-3.2-1b    4096   134.2      21.66   6.2      17.92   7.5    14.0
    qwen3-0.6b       512    58.7       7.50   7.8       6.38   9.2    25.1
    qwen3-0.6b      1024   117.4      14.34   8.2      12.06   9.7    14.3
    qwen3-0.6b      4096   469.8      54.78   8.6      47.00  10.0    13.6

(`stream` reads the pool's size of bytes just written, so the smaller rows are the last-level
cache's rate.) Heads of 64 with many query heads a KV head (Qwen2.5's 7, Llama's 4) stay at
5-7.5 GB/s: a score there is 4 multiply-adds of 16 lanes and its share of a lane sum, and the
3 heads worked on at once (HEADS_AT_ONCE, the 32 registers' limit) make 7 heads three passes.

    .venv/bin/python -m bench.decode_attention [--contexts 512 1024 4096] [--batch 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine.host_memory import huge_page_buffer
from engine.kernels import cpu_kernels, cpu_quant

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
WEIGHT_BYTES = 1 << 30
SHAPES = {  # name: (query heads, KV heads, head size, layers)
    "smollm2-135m": (9, 3, 64, 30),
    "qwen2.5-0.5b": (14, 2, 64, 24),
    "llama-3.2-1b": (32, 8, 64, 16),
    "qwen3-0.6b": (16, 8, 128, 28),
}


def time_step(name: str, context: int, batch: int, rounds: int) -> dict[str, Any]:
    """Median seconds of `rounds` passes over every layer, and the cache bytes one reads."""
    heads, kv_heads, d, layers = SHAPES[name]
    per_seq = -(-context // BLOCK_SIZE)
    blocks = per_seq * batch + 1
    shape = (blocks, layers, 2, BLOCK_SIZE, kv_heads, d)
    pool = huge_page_buffer(2 * blocks * layers * 2 * BLOCK_SIZE * kv_heads * d)
    pool = pool.view(torch.bfloat16).view(shape)
    gen = torch.Generator().manual_seed(context)
    for b in range(blocks):  # a block at a time: no second copy of a large pool
        pool[b] = torch.randn(shape[1:], generator=gen).to(torch.bfloat16)
    order = list(range(blocks))
    random.Random(context).shuffle(order)
    tables = torch.tensor(order[: per_seq * batch], dtype=torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, d, generator=gen)
    out = torch.empty(batch, heads, d)
    calls = []
    for layer in range(layers):
        k, v = pool[:, layer, 0], pool[:, layer, 1]
        calls.append((
            q.data_ptr(), k.data_ptr(), v.data_ptr(), cpu_kernels.CACHE_DTYPE_CODES[k.dtype],
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, d,
            BLOCK_SIZE, k.stride(0), per_seq, d**-0.5, 0, 0.0, None, 1,
        ))  # fmt: skip
    library = cpu_kernels.library()
    assert library is not None, "no C compiler: nothing to time"
    weights = _weights()

    def step() -> float:
        library.stream_read(weights.data_ptr(), weights.numel(), 1)  # a step's weights pass by
        start = time.perf_counter()
        for args in calls:
            library.paged_decode(*args)
        return time.perf_counter() - start

    step()  # warm: the pages, the build
    seconds = statistics.median(step() for _ in range(rounds))
    kv_bytes = batch * context * layers * kv_heads * d * 2 * 2
    stream = huge_page_buffer(kv_bytes // 256 * 256)
    stream.fill_(1)
    stream_gbps = max(cpu_quant.read_rates_gb_s(stream, rounds=5).values())
    return {
        "model": name, "context": context, "batch": batch, "mb": round(kv_bytes / 1e6, 1),
        "ms": round(seconds * 1e3, 3), "gbps": round(kv_bytes / seconds / 1e9, 1),
        "stream_gbps": round(stream_gbps, 1),
    }  # fmt: skip


@functools.cache
def _weights() -> torch.Tensor:
    """A buffer of a model's weights' size (1 GB), read before each timed step as the model's
    layers are: the cache holds what they left, not the KV cache of the step before."""
    weights = huge_page_buffer(WEIGHT_BYTES)
    weights.fill_(1)
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/decode_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'model':14s} {'context':>7s} {'MB':>7s} {'ms':>8s} {'GB/s':>6s} {'stream':>7s}")
    for name in args.models:
        for context in args.contexts:
            row = time_step(name, context, args.batch, args.rounds)
            rows.append(row)
            print(f"{name:14s} {context:7d} {row['mb']:7.1f} {row['ms']:8.2f} {row['gbps']:6.1f}"
                  f" {row['stream_gbps']:7.1f}")  # fmt: skip
    result = {"host": {"machine": platform.machine(), "processor": platform.processor()},
              "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
