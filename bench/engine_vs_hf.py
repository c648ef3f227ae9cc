"""Engine throughput against Hugging Face `generate` on the same model, side by side in one run.

For each concurrency level the engine runs that many requests as one continuous batch; HF runs the
same requests one at a time and as one padded batch. Every request generates exactly `--max-tokens`
tokens (EOS ignored on both sides) so the token counts are equal. Figures are medians of `--repeats`
runs.

    .venv/bin/python -m bench.engine_vs_hf [--model builtin:tiny] [--out bench/results/engine.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.sampling_params import SamplingParams
from engine.llm import LLM

ROOT = Path(__file__).resolve().parents[1]


def make_prompts(
    tokenizer: object, count: int, seed: int, min_len: int, max_len: int
) -> list[list[int]]:
    """Seeded prompts of varied length cut from the shipped corpus."""
    corpus = (ROOT / "tools/tiny_model/data/corpus.txt").read_text()
    ids = tokenizer.encode(corpus)  # type: ignore[attr-defined]
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def time_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(r.outputs[0].token_ids) == max_tokens for r in results)
    return len(prompts) * max_tokens / elapsed


def time_hf(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, pad_id: int
) -> float:
    """HF generate over `prompts` as one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, pad_token_id=pad_id,
        )  # fmt: skip
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == max_tokens
    return len(prompts) * max_tokens / elapsed


def median_of(repeats: int, run: object) -> float:
    return statistics.median(run() for _ in range(repeats))  # type: ignore[operator]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-sequential-requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/engine.json")
    args = parser.parse_args()

    llm = LLM(args.model, num_blocks=4096, max_num_seqs=64, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    pad_id = llm.tokenizer.pad_token_id or 0
    lo, hi = args.prompt_len
    llm.generate(make_prompts(llm.tokenizer, 2, args.seed, lo, hi), SamplingParams(max_tokens=4))

    seq_prompts = make_prompts(llm.tokenizer, args.hf_sequential_requests, args.seed, lo, hi)
    hf_sequential = median_of(
        args.repeats,
        lambda: (
            len(seq_prompts)
            * args.max_tokens
            / sum(args.max_tokens / time_hf(hf, [p], args.max_tokens, pad_id) for p in seq_prompts)
        ),
    )
    levels = {}
    for concurrency in args.concurrency:
        prompts = make_prompts(llm.tokenizer, concurrency, args.seed + concurrency, lo, hi)
        engine = median_of(args.repeats, lambda p=prompts: time_engine(llm, p, args.max_tokens))
        batched = median_of(args.repeats, lambda p=prompts: time_hf(hf, p, args.max_tokens, pad_id))
        levels[str(concurrency)] = {
            "engine_output_tokens_per_s": round(engine, 1),
            "hf_sequential_output_tokens_per_s": round(hf_sequential, 1),
            "hf_batched_output_tokens_per_s": round(batched, 1),
            "vs_hf_sequential": round(engine / hf_sequential, 2),
            "vs_hf_batched": round(engine / batched, 2),
        }
        print(f"concurrency {concurrency}: {levels[str(concurrency)]}", flush=True)
    result = {
        "benchmark": "engine",
        "model": args.model,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "concurrency": levels,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
