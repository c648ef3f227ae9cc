"""One prefill in process, timed and profiled: where a cluster's time to first token goes.

A prompt of random token ids, one output token, one torch thread (as each cluster engine runs),
prefix caching off so every repeat computes; the median of the repeats, then the torch
profiler's op table of one more (the C kernels show as `cpu_kernels::<name>`).

    .venv/bin/python -m bench.prefill_profile [--model builtin:qwen3-moe-bench] [--tokens 192]
                                              [--chunk 512] [--no-profile]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen3-moe-bench")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=0,
                        help="prompt tokens a step; 0: the whole prompt in one")  # fmt: skip
    parser.add_argument("--no-profile", action="store_true", help="the timings only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
              max_num_batched_tokens=args.chunk or max(512, args.tokens))  # fmt: skip
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill() -> float:
        prompt = [rng.randrange(100, vocab - 1) for _ in range(args.tokens)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start

    prefill()  # warm: weights packed, kernels built
    times = [prefill() for _ in range(args.repeats)]
    median_ms = statistics.median(times) * 1e3
    each_ms = [round(t * 1e3) for t in times]
    chunk = f", chunks of {args.chunk}" if args.chunk else ""
    print(f"{args.model} {args.dtype}: {args.tokens} tokens{chunk}, {median_ms:.0f} ms ({each_ms})")
    if args.no_profile:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        prefill()
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
