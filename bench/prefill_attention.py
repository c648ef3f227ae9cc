"""Time the CPU prefill attention kernel (cpu_kernels.c's paged_prefill) alone on long prompts.

One fresh prompt of 1k, 4k and 8k tokens over a bfloat16 paged cache in Qwen2.5-0.5B's shape
(14 query heads, 2 KV heads, head_dim 64, blocks of 16 in shuffled order), one torch thread, one
layer; best of a few calls (the dev VM's 2 cores are shared). Two query kinds:

- `bf16`: a bfloat16 model's queries, which take the dot-product path (cpu_prefill_pairs.c)
  where the CPU has AVX512-BF16;
- `f32`: the same queries plus a float32 nudge, which the pairs path refuses (it would round
  them), so the float32 tiles (prefill_sequence) run: the kernel as it was before the pairs path.

GFLOPS counts the causal multiply-adds (2 x d for q.k and for p.v per visible key). Writes JSON
(default bench/results/prefill_attention.json).

    .venv/bin/python -m bench.prefill_attention [--tokens 1024 4096 8192] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from engine.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16


def time_prefill(tokens: int, kind: str, repeats: int) -> dict[str, Any]:
    """Best and median seconds of `repeats` calls on one prompt of `tokens` tokens."""
    gen = torch.Generator().manual_seed(tokens)
    blocks = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    shape = (blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).float()
    if kind == "f32":
        q = q + 1e-6 * torch.randn(q.shape, generator=gen)  # not a bfloat16: the float32 tiles
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, cu, lens, HEAD_DIM**-0.5)
    cpu_kernels.paged_prefill_attention(*args)  # warm: the build, the pages
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cpu_kernels.paged_prefill_attention(*args)
        times.append(time.perf_counter() - start)
    flops = 4 * HEAD_DIM * NUM_HEADS * tokens * (tokens + 1) / 2
    best = min(times)
    return {
        "tokens": tokens,
        "queries": kind,
        "best_ms": round(best * 1e3, 2),
        "median_ms": round(sorted(times)[len(times) // 2] * 1e3, 2),
        "gflops": round(flops / best / 1e9, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--kinds", nargs="+", default=["bf16", "f32"], choices=["bf16", "f32"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/prefill_attention.json")
    args = parser.parse_args()
    assert cpu_kernels.library() is not None, "no C compiler: the kernel cannot be built"
    torch.set_num_threads(1)
    rows = []
    for tokens in args.tokens:
        for kind in args.kinds:
            repeats = max(3, 8192 // tokens * 2)
            rows.append(time_prefill(tokens, kind, repeats))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "cpu": platform.processor() or platform.machine(),
        "bf16_pairs": cpu_kernels.prefill_pairs_available(),
        "shape": {"heads": NUM_HEADS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "threads": 1,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
