"""Time the CPU prefill attention kernel (cpu_kernels.c's paged_prefill) alone on long prompts.

One fresh prompt of 1k, 4k and 8k tokens over a bfloat16 paged cache in Qwen2.5-0.5B's shape
(14 query heads, 2 KV heads, head_dim 64; `--shape qwen3-0.6b`: 16, 8, 128), blocks of 16 in
shuffled order, one torch thread, one layer; best of a few calls (the dev VM's 2 cores are
shared). Three kinds:

- `amx`: a bfloat16 model's queries on the bfloat16 path (cpu_prefill_pairs.c) with AMX tiles,
  where the CPU has AMX-BF16 (else the same as `bf16`);
- `bf16`: the same path on AVX512-BF16's dot products (use_prefill_amx(False));
- `f32`: the same queries in float32 plus a nudge (a float32 model's), which the float32 tiles
  (prefill_sequence) take: the kernel as it was before the pairs path.

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
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen3-0.6b": (16, 8, 128)}  # heads, KV heads, head_dim
BLOCK_SIZE = 16
KINDS = ("amx", "bf16", "f32")


def time_prefill(tokens: int, kind: str, repeats: int, shape_name: str) -> dict[str, Any]:
    """Best and median seconds of `repeats` calls on one prompt of `tokens` tokens."""
    heads, kv_heads, head_dim = SHAPES[shape_name]
    gen = torch.Generator().manual_seed(tokens)
    blocks = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
    if kind == "f32":  # a float32 model's queries: the float32 tiles
        q = q.float() + 1e-6 * torch.randn(q.shape, generator=gen)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, cu, lens, head_dim**-0.5)
    cpu_kernels.use_prefill_amx(kind == "amx")
    try:
        cpu_kernels.paged_prefill_attention(*args)  # warm: the build, the pages
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            cpu_kernels.paged_prefill_attention(*args)
            times.append(time.perf_counter() - start)
    finally:
        cpu_kernels.use_prefill_amx(True)
    flops = 4 * head_dim * heads * tokens * (tokens + 1) / 2
    best = min(times)
    return {
        "shape": shape_name,
        "tokens": tokens,
        # what ran: "amx" falls back to the dot products where the tiles are not to be had
        "path": "bf16" if kind == "amx" and not cpu_kernels.prefill_amx_ready() else kind,
        "best_ms": round(best * 1e3, 2),
        "median_ms": round(sorted(times)[len(times) // 2] * 1e3, 2),
        "gflops": round(flops / best / 1e9, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--shape", nargs="+", default=["qwen2.5-0.5b"], choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/prefill_attention.json")
    args = parser.parse_args()
    assert cpu_kernels.library() is not None, "no C compiler: the kernel cannot be built"
    torch.set_num_threads(1)
    rows = []
    for shape in args.shape:
        for tokens in args.tokens:
            for kind in args.kinds:
                repeats = max(3, 8192 // tokens * 2)
                rows.append(time_prefill(tokens, kind, repeats, shape))
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "cpu": platform.processor() or platform.machine(),
        "bf16_pairs": cpu_kernels.prefill_pairs_available(),
        "amx": cpu_kernels.prefill_amx_ready(),
        "shapes": {
            name: dict(zip(("heads", "kv_heads", "head_dim"), SHAPES[name], strict=True))
            for name in args.shape
        },
        "threads": 1,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
