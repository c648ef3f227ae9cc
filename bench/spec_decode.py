"""Speculative decoding (n-gram proposals, and a draft model with --draft-model) on a repetitive
workload: the cluster with `speculative` off and on, and vLLM with its n-gram speculation off and
on, in one run.

Workload (seeded): chat prompts whose answer copies the prompt, as users of prompt lookup send
them: "summarise this passage, quoting it" over passages of bench/data/gpl-3.txt, and "repeat this
code" over functions of this repository, the answer's opening fence already in the prompt.
Greedy, max_tokens 128 (the model may stop earlier: EOS is not ignored, so every side generates
the same answer). Each setting runs the prompts at 1 and at 8 concurrent streaming clients.

Per setting and concurrency: time per output token (TPOT: a request's stream from its first to
its last token ÷ its tokens after the first; the median over requests) and the inter-chunk gap
p50 (ITL, as `vllm bench serve` measures: with speculation a chunk may carry several tokens),
TTFT p50, output tokens/s, and the acceptance rate (accepted ÷ proposed tokens; the cluster's
from /cluster_info, vLLM's from its /metrics). `identical_to_off`: the share of answers equal
token for token to the same system's answers without speculation.

    .venv/bin/python -m bench.spec_decode [--model builtin:smollm2-135m] [--no-vllm]
                                          [--disable-by-batch-size N ...]
                                          [--draft-model builtin:smollm2-135m-q4 ...]
                                          [--out bench/results/spec_decode.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx

from bench.kv_offload import BenchCluster, cluster_info, wait_idle_info
from bench.peers import VLLM_VENV, VllmServer, ensure_vllm

ROOT = Path(__file__).resolve().parents[1]
K, LOOKUP_MIN, LOOKUP_MAX = 4, 2, 4  # vLLM's usual n-gram settings, on both sides
MAX_TOKENS = 128
LEVELS = {1: 4, 8: 16}  # concurrent clients -> requests
CODE_FILES = ["engine/block_pool.py", "engine/kv_cache_manager.py", "engine/scheduler.py",
              "engine/sampler.py", "frontend/metrics.py", "common/config.py"]  # fmt: skip


def chat(user: str, answer_start: str = "") -> str:
    """SmolLM2's ChatML, the assistant's turn opened (and begun with `answer_start`)."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer_start}"


def make_prompts(count: int, seed: int) -> list[str]:
    """Half passages to summarise by quoting, half code to repeat; none repeats another."""
    rng = random.Random(seed)
    text = (ROOT / "bench/data/gpl-3.txt").read_text().split("\n\n")
    passages = [p for p in text if 400 <= len(p) <= 1600]
    functions = [
        f
        for path in CODE_FILES
        for f in re.findall(
            r"\n(    def [^\n]+\n(?:(?:        [^\n]*)?\n){8,30})", (ROOT / path).read_text()
        )
    ]
    rng.shuffle(passages)
    rng.shuffle(functions)
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            prompts.append(chat(f"Summarise this passage, quoting it.\n\n{passages[i // 2]}"))
        else:
            code = functions[i // 2]
            prompts.append(chat(f"Repeat this code.\n```python\n{code}```", "```python\n"))
    return prompts


@dataclass(slots=True)
class Stream:
    ttft_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    stream, start = Stream(), time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line.removeprefix("data: "))["choices"]
            tokens = (choices[0].get("token_ids") or []) if choices else []
            if tokens:
                stream.chunk_times.append(time.perf_counter() - start)
                stream.token_ids += tokens
    stream.ttft_s = stream.chunk_times[0] if stream.chunk_times else float("nan")
    return stream


async def run_level(url: str, model: str, prompts: list[str], concurrency: int) -> list[Stream]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt: str) -> Stream:
            async with limit:
                return await stream_one(client, model, prompt)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def summarize(streams: list[Stream], duration_s: float) -> dict[str, float]:
    tpots = [
        (s.chunk_times[-1] - s.chunk_times[0]) / (len(s.token_ids) - 1)
        for s in streams
        if len(s.token_ids) > 1
    ]
    gaps = [b - a for s in streams for a, b in zip(s.chunk_times, s.chunk_times[1:], strict=False)]
    tokens = sum(len(s.token_ids) for s in streams)
    return {
        "requests": len(streams),
        "output_tokens": tokens,
        "tpot_p50_s": round(statistics.median(tpots), 5),
        "itl_p50_s": round(statistics.median(gaps), 5) if gaps else None,
        "tokens_per_chunk": round(tokens / max(1, sum(len(s.chunk_times) for s in streams)), 3),
        "ttft_p50_s": round(statistics.median(s.ttft_s for s in streams), 4),
        "output_tokens_per_s": round(tokens / duration_s, 2),
    }


def measure(url: str, model: str, prompts: list[str], counters) -> tuple[dict, list[list[int]]]:
    """Every level on one server: its figures, and the answers (prompt order, all levels)."""
    levels, answers = {}, []
    for concurrency, count in LEVELS.items():
        batch = prompts[:count]
        before = counters()
        start = time.perf_counter()
        streams = asyncio.run(run_level(url, model, batch, concurrency))
        figures = summarize(streams, time.perf_counter() - start)
        proposed, accepted = (a - b for a, b in zip(counters(), before, strict=True))
        figures["proposed_tokens"], figures["accepted_tokens"] = proposed, accepted
        figures["acceptance_rate"] = round(accepted / proposed, 4) if proposed else None
        levels[str(concurrency)] = figures
        answers += [s.token_ids for s in streams]
    return levels, answers


def cluster_counters(url: str):
    def read() -> tuple[int, int]:
        time.sleep(2.2)  # a heartbeat since the last request (stats ride on it)
        gens = [w for w in cluster_info(url).workers if w.role in ("generation", "context")]
        return (sum(w.spec_decode_num_draft_tokens for w in gens),
                sum(w.spec_decode_num_accepted_tokens for w in gens))  # fmt: skip

    return read


def vllm_counters(url: str):
    def read() -> tuple[int, int]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        values = {}
        for name in ("draft_tokens", "accepted_tokens"):
            found = re.findall(rf"^vllm:spec_decode_num_{name}_total\{{[^}}]*\}} (\S+)", text, re.M)
            values[name] = int(sum(float(v) for v in found))
        return values["draft_tokens"], values["accepted_tokens"]

    return read


SPEC_SETTINGS = {"method": "ngram", "num_speculative_tokens": K,
                 "prompt_lookup_min": LOOKUP_MIN, "prompt_lookup_max": LOOKUP_MAX}  # fmt: skip
VLLM_SPEC = json.dumps(SPEC_SETTINGS)


def run_cluster(
    model: str, prompts: list[str], workdir: Path, mode: str, name: str, spec: dict | None
) -> dict:
    """One cluster, `spec` its speculative keys (None: off)."""
    print(f"[spec_decode] cluster {mode} {name}", flush=True)
    extra = f"speculative: {json.dumps(spec)}\n" if spec else ""  # JSON is YAML
    cluster = BenchCluster(model, "num_blocks: 2048", workdir, f"{mode}-{name}", mode, extra)
    try:
        asyncio.run(run_level(cluster.url, model, prompts[:1], 1))  # warm up
        levels, answers = measure(cluster.url, model, prompts, cluster_counters(cluster.url))
        info = wait_idle_info(cluster.url)
        engines = [w for w in info.workers if w.role in ("context", "generation")]
        held = sum(w.blocks_used + w.blocks_leased for w in engines)
        return {"levels": levels, "answers": answers, "blocks_held_after": held}
    finally:
        cluster.stop()


def run_vllm(model: str, model_dir: Path, prompts: list[str], workdir: Path, spec: bool) -> dict:
    print(f"[spec_decode] vllm {'spec' if spec else 'off'}", flush=True)
    extra = ("--speculative-config", VLLM_SPEC) if spec else ()
    server = VllmServer(ensure_vllm(), model, model_dir, "float32", workdir, extra_args=extra)
    try:
        asyncio.run(run_level(server.url, model, prompts[:1], 1))
        levels, answers = measure(server.url, model, prompts, vllm_counters(server.url))
        return {"levels": levels, "answers": answers}
    except Exception as error:  # noqa: BLE001 - reported in the results, the run goes on
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    finally:
        server.stop()


def compare(off: dict, on: dict) -> None:
    """on["identical_to_off"]: the share of answers equal token for token to `off`'s."""
    if "answers" in off and "answers" in on:
        same = sum(a == b for a, b in zip(off["answers"], on["answers"], strict=True))
        on["identical_to_off"] = round(same / len(off["answers"]), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--modes", nargs="+", default=["disaggregated"])
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--disable-by-batch-size", type=int, nargs="*", default=[],
                        help="more cluster settings: n-gram with speculative.disable_by_batch_size "
                        "N (vLLM 0.32 has no such key)")  # fmt: skip
    parser.add_argument("--draft-model", nargs="*", default=[],
                        help="more cluster settings: method draft_model with this draft, k as "
                        "n-gram's (vLLM is run with n-gram speculation only)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/spec_decode.json")
    args = parser.parse_args()
    from engine.builtin_build import ensure_builtin  # torch: only once the arguments parsed

    model_dir = ensure_builtin(args.model, "float32")
    prompts = make_prompts(max(LEVELS.values()), args.seed)
    results: dict = {
        "model": args.model, "dtype": "float32", "host": platform.node(),
        "speculative": SPEC_SETTINGS,
        "max_tokens": MAX_TOKENS, "levels": LEVELS, "systems": {},
    }  # fmt: skip
    with TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for mode in args.modes:
            settings = {"off": None, "ngram": SPEC_SETTINGS}
            for n in args.disable_by_batch_size:
                settings[f"ngram_disable_by_batch_size_{n}"] = {
                    **SPEC_SETTINGS,
                    "disable_by_batch_size": n,
                }
            for draft in args.draft_model:
                settings[f"draft_model_{draft}"] = {
                    "method": "draft_model", "model": draft, "num_speculative_tokens": K,
                }  # fmt: skip
            system = {
                name: run_cluster(args.model, prompts, workdir, mode, name, spec)
                for name, spec in settings.items()
            }
            for name in settings:
                if name != "off":
                    compare(system["off"], system[name])
            results["systems"][f"pdcluster-{mode}"] = system
        if not args.no_vllm:
            off = run_vllm(args.model, model_dir, prompts, workdir, spec=False)
            on = run_vllm(args.model, model_dir, prompts, workdir, spec=True)
            compare(off, on)
            results["systems"]["vllm"] = {"off": off, "ngram": on, "venv": str(VLLM_VENV)}
    for system in results["systems"].values():
        for setting in system.values():
            if isinstance(setting, dict):
                setting.pop("answers", None)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
