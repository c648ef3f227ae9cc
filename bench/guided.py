"""Per-token cost of guided decoding: constrained vs free decoding on the same engine, side by side.

For each batch size, the same seeded prompts are decoded free, under a JSON schema, and under a
regex; the figure is seconds per generated token (median of `--repeats` runs), and the overhead
is constrained / free. The constraints are built by `common.guided`, exactly as the frontend does.

    .venv/bin/python -m bench.guided [--model builtin:tiny] [--out bench/results/guided.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from common import guided
from common.sampling_params import GuidedDecoding, SamplingParams
from engine.llm import LLM
from tools.tiny_model.build import TEST_PROMPTS

ROOT = Path(__file__).resolve().parents[1]

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 200},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 40}},
    },
    "required": ["title", "items"],
}
CONSTRAINTS: dict[str, GuidedDecoding | None] = {
    "free": None,
    "json_schema": guided.json_schema(SCHEMA),
    "regex": guided.regex("[a-z ]{1,1000}"),
}


def seconds_per_token(
    llm: LLM, batch: int, spec: GuidedDecoding | None, max_tokens: int
) -> tuple[float, int]:
    prompts = [TEST_PROMPTS[i % len(TEST_PROMPTS)] for i in range(batch)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, guided=spec)
        for i in range(batch)
    ]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return elapsed / tokens, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench/results/guided.json"))
    args = parser.parse_args()
    llm = LLM(args.model, num_blocks=2048, block_size=16)
    seconds_per_token(llm, 1, CONSTRAINTS["json_schema"], 8)  # warm-up (llguidance tokenizer)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        row: dict[str, object] = {"batch": batch}
        for name, spec in CONSTRAINTS.items():
            runs = [
                seconds_per_token(llm, batch, spec, args.max_tokens) for _ in range(args.repeats)
            ]
            row[f"{name}_ms_per_token"] = round(statistics.median(r[0] for r in runs) * 1e3, 4)
            row[f"{name}_tokens"] = runs[0][1]
        for name in ("json_schema", "regex"):
            row[f"{name}_overhead"] = round(
                row[f"{name}_ms_per_token"] / row["free_ms_per_token"],
                3,  # type: ignore[operator]
            )
        rows.append(row)
        print(json.dumps(row))
    result = {
        "bench": "guided",
        "model": args.model,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
