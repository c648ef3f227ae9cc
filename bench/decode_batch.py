"""A bfloat16 model's decode step at several batch sizes: the C step against oneDNN's layers.

The C decode step (engine/models/cpu_decode.py) runs a decode-only batch as one C call over its
own copy of the weights (bfloat16 pairs: AVX512-BF16's dot products, or from 8 rows AMX tiles
where the CPU has them, cpu_linear.c); without it the same batch runs layer by layer through
oneDNN's packed matmuls, which multiply in AMX tiles where the CPU has them. Which is faster
depends on the batch and the CPU: this times them in process, alternately (`c_decode_max_rows`
unlimited, then 0; on an AMX host also the C step with its tiles turned off,
`c_step_dot_products`), one thread, B sequences of ~200-token prompts decoding 24 tokens each;
the median step with all B decoding. Writes JSON (default bench/results/decode_batch.json).

    .venv/bin/python -m bench.decode_batch --model builtin:qwen3-0.6b-bench --batch 1 8 16 32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from common.sampling_params import SamplingParams
from engine.kernels import cpu_kernels
from engine.llm import LLM
from engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS, OUTPUT_TOKENS = 200, 24


def median_step_s(engine: LLMEngine, batch: int, tag: str) -> float:
    """The median step with every one of `batch` sequences decoding (the first two left out)."""
    for i in range(batch):
        engine.add_request(
            f"{tag}-{i}",
            list(range(100 + i, 100 + i + PROMPT_TOKENS)),
            SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True),
        )
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == batch:
            steps.append(time.perf_counter() - start)
    return statistics.median(steps[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen3-0.6b-bench")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/decode_batch.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLM(args.model, dtype="bfloat16", kv_cache_dtype="bfloat16").engine
    model = engine.runner.model
    own_limit = model.c_decode_max_rows
    assert model.c_decode_pairs, "the C step has no bfloat16 pairs here (no AVX512-BF16)"
    tiles = cpu_kernels.linear_amx_ready()
    rows: list[dict[str, Any]] = []
    try:
        for batch in args.batch:
            paths = [("c_step", 1 << 30, True), ("onednn", 0, True)]
            if tiles:
                paths.insert(1, ("c_step_dot_products", 1 << 30, False))
            times: dict[str, list[float]] = {path: [] for path, _, _ in paths}
            for repeat in range(args.repeats):
                for path, limit, amx in paths:
                    model.c_decode_max_rows = limit
                    cpu_kernels.use_linear_amx(amx)
                    times[path].append(median_step_s(engine, batch, f"{path}-{batch}-{repeat}"))
            row = {"batch": batch, **{p: round(min(t) * 1e3, 1) for p, t in times.items()}}
            row["engine_picks"] = "c_step" if batch <= own_limit else "onednn"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        model.c_decode_max_rows = own_limit
        cpu_kernels.use_linear_amx(True)
    result = {
        "cpu": platform.processor() or platform.machine(),
        "amx_bf16": cpu_kernels.cpu_has_amx_bf16(),
        "c_step_tiles": tiles,
        "model": args.model,
        "c_decode_max_rows": own_limit,
        "step_ms": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
