"""What kv_cache_dtype bfloat16 and int8 cost in accuracy, and save in memory, against auto.

Per model and KV dtype, in process through the engine (the CPU path: C kernels, the C decode
step):
- the log-likelihood and perplexity of a fixed local text (the GPL-3 on this machine, its first
  `--text-tokens` tokens, one prompt) from the engine's prompt log-probs, and the mean
  |delta log-prob| against auto on the same tokens;
- `--prompts` greedy continuations of `--max-tokens` tokens, prompts cut from the Apache-2.0
  licence's paragraphs: how many are token for token auto's, and the mean |delta log-prob| of
  auto's continuation tokens scored (teacher-forced) with this cache;
- the KV block's bytes and the blocks (and tokens) one GiB holds.
And the same against auto for auto's own cache read by the torch attention path (float32 sums in
another order): the noise floor those differences are to be read against.

    .venv/bin/python -m bench.kv_cache_dtype [--models builtin:smollm2-135m ...]
        [--out bench/results/kv_cache_dtype.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM

ROOT = Path(__file__).resolve().parents[1]
TEXT = Path("/usr/share/common-licenses/GPL-3")
PROMPT_SOURCE = Path("/usr/share/common-licenses/Apache-2.0")
# (row name, kv_cache_dtype, attention_backend). The last: auto's cache through the torch
# attention path, float32 sums in another order, no change to the cache: the noise floor, what
# any perturbation of that size costs (a model whose matmuls quantize their activations, as the
# q4 GGUF's do, turns it into whole int8 steps).
CONFIGS = (
    ("auto", "auto", "auto"),
    ("bfloat16", "bfloat16", "auto"),
    ("int8", "int8", "auto"),
    ("auto, torch attention (noise floor)", "auto", "torch"),
)
BLOCK_SIZE = 16
GIB = 1 << 30


def prompt_texts(count: int, words: int) -> list[str]:
    """The first `words` words of the licence's first `count` paragraphs of at least that many."""
    paragraphs = [" ".join(p.split()) for p in PROMPT_SOURCE.read_text().split("\n\n")]
    long_enough = [p for p in paragraphs if len(p.split()) >= words]
    if len(long_enough) < count:
        raise SystemExit(f"{PROMPT_SOURCE} has {len(long_enough)} paragraphs of {words} words")
    return [" ".join(p.split()[:words]) for p in long_enough[:count]]


def prompt_logprobs(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's log-probs of its tokens 1.. (teacher-forced), from the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    results = llm.generate(sequences, params)
    return [torch.tensor([lp for lp, _ in r.prompt_logprobs or []]) for r in results]


@dataclass(frozen=True)
class Workload:
    text: str
    text_tokens: int
    prompts: list[str]
    max_tokens: int


def measure(model: str, kv_dtype: str, backend: str, work: Workload,
            reference: list[list[int]] | None) -> dict[str, object]:  # fmt: skip
    """One engine with this KV cache: the text's log-probs, greedy continuations, and the
    log-probs of `reference`'s continuations (auto's; None: its own) after each prompt."""
    start = time.perf_counter()
    llm = LLM(
        model, kv_cache_dtype=kv_dtype, attention_backend=backend, block_size=BLOCK_SIZE,
        num_blocks=1024,
    )  # fmt: skip
    text_ids = llm.tokenizer(work.text).input_ids[: work.text_tokens]
    prompts = [llm.tokenizer(t).input_ids for t in work.prompts]
    (text_logprobs,) = prompt_logprobs(llm, [text_ids])
    greedy = SamplingParams(temperature=0.0, max_tokens=work.max_tokens, ignore_eos=True)
    continuations = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
    reference = reference or continuations
    scored = prompt_logprobs(llm, [p + c for p, c in zip(prompts, reference, strict=True)])
    forced = torch.cat([lp[len(p) - 1 :] for lp, p in zip(scored, prompts, strict=True)])
    print(f"{model} {kv_dtype} {backend}: {time.perf_counter() - start:.1f} s", flush=True)
    return {
        "text_ids": text_ids,
        "text_logprobs": text_logprobs,
        "continuations": continuations,
        "forced": forced,
        "block_bytes": llm.engine.kv_cache.block_num_bytes,
        "pool_dtype": str(llm.engine.kv_cache.pool.dtype).removeprefix("torch."),
    }


def run_model(model: str, work: Workload) -> dict[str, dict]:
    auto = measure(model, "auto", "auto", work, None)
    reference: list[list[int]] = auto["continuations"]  # type: ignore[assignment]
    rows = {}
    for name, kv_dtype, backend in CONFIGS:
        run = auto if name == "auto" else measure(model, kv_dtype, backend, work, reference)
        text_logprobs: torch.Tensor = run["text_logprobs"]  # type: ignore[assignment]
        nll = -float(text_logprobs.mean())
        delta_text = (text_logprobs - auto["text_logprobs"]).abs()  # type: ignore[operator]
        delta_forced = (run["forced"] - auto["forced"]).abs()  # type: ignore[operator]
        pairs = zip(run["continuations"], auto["continuations"], strict=True)  # type: ignore[call-overload]
        same = sum(c == r for c, r in pairs)
        block_bytes: int = run["block_bytes"]  # type: ignore[assignment]
        rows[name] = {
            "pool_dtype": run["pool_dtype"],
            "text_tokens": len(run["text_ids"]),  # type: ignore[arg-type]
            "text_nll_per_token": round(nll, 5),
            "text_perplexity": round(math.exp(nll), 4),
            "text_mean_abs_delta_logprob": round(float(delta_text.mean()), 6),
            "text_max_abs_delta_logprob": round(float(delta_text.max()), 5),
            "continuations_identical": f"{same}/{len(work.prompts)}",
            "continuation_mean_abs_delta_logprob": round(float(delta_forced.mean()), 6),
            "continuation_max_abs_delta_logprob": round(float(delta_forced.max()), 5),
            "block_bytes": block_bytes,
            "blocks_per_gib": GIB // block_bytes,
            "tokens_per_gib": GIB // block_bytes * BLOCK_SIZE,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["builtin:smollm2-135m", "builtin:smollm2-135m-q4"]
    )
    parser.add_argument("--text-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--words", type=int, default=24, help="words of each prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/kv_cache_dtype.json")
    args = parser.parse_args()
    work = Workload(
        TEXT.read_text(), args.text_tokens, prompt_texts(args.prompts, args.words), args.max_tokens
    )
    results = {
        "host": {"machine": platform.machine(), "threads": torch.get_num_threads()},
        "text": f"{TEXT}, first {args.text_tokens} tokens",
        "prompts": f"{args.prompts} paragraphs of {PROMPT_SOURCE}, {args.words} words each; "
        f"greedy, {args.max_tokens} tokens, EOS ignored",
        "block_size": BLOCK_SIZE,
        "models": {model: run_model(model, work) for model in args.models},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["models"], indent=2))


if __name__ == "__main__":
    main()
