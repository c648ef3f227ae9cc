"""Serving benchmark: the cluster over HTTP against the in-process engine and Hugging Face
`generate`, side by side in one run, written as JSON (stable keys) and PNG plots.

    .venv/bin/python -m bench.serving [--device cpu|cuda] [--model builtin:tiny]
                                      [--out bench/results/latest.json] [--repeats 3]
    .venv/bin/python -m bench.serving --real-model      # SmolLM2-135M-Instruct, sized for it

`--real-model` runs builtin:smollm2-135m (30 layers: about 15x the tiny model's work per token)
with a workload of its size: prompts of 128-256 tokens, 128 output tokens, 1 / 8 / 32 clients,
one repeat, into bench/results/smollm2.json. Every option given beside it still wins.

Workload (seeded, fresh prompts for every run so that none is served from an earlier run's
prefix cache): prompts of 64-512 tokens cut from the shipped corpus, outputs of 64-256 tokens
(EOS ignored, so every side generates the same tokens), streaming clients at each concurrency
level. Figures are medians of `--repeats` runs.

- `levels.<c>`: the default (disaggregated) cluster at c concurrent streaming clients: output
  tokens/s, requests/s, TTFT and inter-token latency p50/p99.
- `pipeline_efficiency`: cluster tokens/s at 32 clients ÷ the in-process engine (no HTTP, no
  ZMQ, no NIXL) on the same requests, at most 32 at a time like the clients, run right after
  each cluster run; the median of those paired ratios (`pipeline_efficiency_runs`).
- `vs_hf_sequential` / `vs_hf_batched`: cluster tokens/s at 32 clients ÷ HF generate one request
  at a time / as one padded batch.
- `prefix_ttft_ratio`: TTFT of a 1k-token prompt the second time (prefix cache warm) ÷ the first.
- `aggregated`: the same 32-client run on an aggregated cluster, and `disagg_vs_agg`;
  with `--aggregated-levels`, every level on it too (`aggregated_levels.<c>`).
- `profile`: one more 32-client run, profiled (bench/cluster_profile.py): the cores each process
  kept busy and its hottest functions; py-spy's raw stacks beside the JSON.

`--no-baselines` skips the in-process engine and HF generate (their keys are null): the clusters
alone, as bench/gpu_run.sh runs them on a full-size checkpoint within its time."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from bench.cluster_profile import ClusterProfile
from common.sampling_params import SamplingParams
from engine.llm import LLM
from launcher.run import SERVING

ROOT = Path(__file__).resolve().parents[1]

HEADLINE_CONCURRENCY = 32
REAL_MODEL_PRESET = {
    "model": "builtin:smollm2-135m",
    "concurrency": [1, 8, 32],
    "prompt_len": [128, 256],
    "output_len": [128, 128],
    "hf_sequential_requests": 2,
    "repeats": 1,
    "out": str(ROOT / "bench/results/smollm2.json"),
}
PREFIX_SEED = 1_000_000  # apart from the levels' seeds: the cold prompt must share no prefix
KV_BLOCK_SIZE, KV_NUM_BLOCKS = 16, 4096  # each bench cluster's KV pool (a worker's)


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int


def corpus_tokens(tokenizer: object) -> list[int]:
    return tokenizer.encode((ROOT / "tools/tiny_model/data/corpus.txt").read_text())  # type: ignore[attr-defined]


def make_workload(corpus: list[int], count: int, seed: int, prompt_len: tuple[int, int],
                  output_len: tuple[int, int]) -> list[Request]:  # fmt: skip
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.randint(*prompt_len)
        start = rng.randrange(0, len(corpus) - length)
        requests.append(Request(corpus[start : start + length], rng.randint(*output_len)))
    return requests


# --- a cluster --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """`orchestrator up` on free loopback ports; stopped with SIGTERM."""

    def __init__(
        self,
        model: str,
        device: str,
        mode: str,
        workdir: Path,
        dtype: str | None = None,
        profile_dir: Path | None = None,
        kv_cache_dtype: str = "auto",
        orchestrator_keys: str = "",
    ) -> None:
        """`orchestrator_keys`: more keys for cluster.yaml's orchestrator section (an
        ablation's, as "max_prefill_queue_size: 0")."""
        self.port = free_port()
        orchestrator = ", ".join(filter(None, ["router: kv_aware", orchestrator_keys]))
        config = workdir / f"cluster-{mode}.yaml"
        dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
        config.write_text(
            f"model: {model}\nmode: {mode}\ndevice: {device}\ndtype: {dtype}\n"
            f"frontend: {{port: {self.port}}}\n"
            f'orchestrator: {{address: "tcp://127.0.0.1:{free_port()}", {orchestrator}}}\n'
            "generation_workers: {max_num_seqs: 64}\n"
            f"kv_cache: {{block_size: {KV_BLOCK_SIZE}, num_blocks: {KV_NUM_BLOCKS}, "
            f"dtype: {kv_cache_dtype}}}\n"
            + (f"profiler: {{dir: {profile_dir}}}\n" if profile_dir else "")
        )
        self.log = (workdir / f"cluster-{mode}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "up", str(config)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_serving(mode)
        except BaseException:  # a failed start, or the bench stopped meanwhile (SIGTERM)
            self.stop()
            raise

    def _wait_serving(self, mode: str) -> None:
        log_path = Path(self.log.name)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {mode} cluster exited; see {self.log.name}")
            if SERVING in log_path.read_text(errors="replace"):
                return  # every process is registered and /health said 200
            time.sleep(0.5)
        raise RuntimeError(f"the {mode} cluster did not start; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)
        self.log.close()


async def stream_one(
    client: httpx.AsyncClient, model: str, request: Request
) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streamed completion, after checking from its usage chunk
    that it generated every token the throughput figures count."""
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    stamps: list[float] = []
    last = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                last = line
    stamps.pop()  # the usage chunk carries no text
    generated = json.loads(last.removeprefix("data: "))["usage"]["completion_tokens"]
    if generated != request.max_tokens:
        raise RuntimeError(f"asked for {request.max_tokens} tokens, the cluster sent {generated}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - start, gaps


async def run_clients(url: str, model: str, requests: list[Request], concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def gated(request: Request) -> tuple[float, list[float]]:
            async with gate:
                return await stream_one(client, model, request)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(r) for r in requests))
        elapsed = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    gaps = sorted(g for r in results for g in r[1])
    tokens = sum(r.max_tokens for r in requests)
    return {
        "output_tokens_per_s": tokens / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
    }


def percentile(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else 0.0


def median_dict(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 6) for k in runs[0]}  # µs


def prefix_ttft_ratio(url: str, model: str, corpus: list[int], repeats: int) -> float:
    """A 1k-token prompt twice: the second run's prefill reads the prefix cache."""
    ratios = []
    for i in range(repeats):
        prompt = make_workload(corpus, 1, PREFIX_SEED + i, (1024, 1024), (1, 1))[0]
        request = Request(prompt.prompt, 4)
        cold = asyncio.run(run_clients(url, model, [request], 1))["ttft_p50_s"]
        warm = asyncio.run(run_clients(url, model, [request], 1))["ttft_p50_s"]
        ratios.append(warm / cold)
    return statistics.median(ratios)


# --- the baselines ----------------------------------------------------------------------------


def engine_tokens_per_s(llm: LLM, requests: list[Request]) -> float:
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    llm.generate([r.prompt for r in requests], params)
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start)


def hf_tokens_per_s(
    model: torch.nn.Module, requests: list[Request], pad_id: int, device: str
) -> float:
    """HF generate over the requests as one left-padded batch (each to the longest output)."""
    width = max(len(r.prompt) for r in requests)
    max_new = max(r.max_tokens for r in requests)
    ids = torch.tensor(
        [[pad_id] * (width - len(r.prompt)) + r.prompt for r in requests], device=device
    )
    mask = (torch.arange(width, device=device) >= torch.tensor(
        [width - len(r.prompt) for r in requests], device=device).unsqueeze(1)).long()  # fmt: skip
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                       min_new_tokens=max_new, pad_token_id=pad_id)  # fmt: skip
    return len(requests) * max_new / (time.perf_counter() - start)


def rounded(value: float | None, digits: int) -> float | None:
    """None stays None (a baseline not run: --no-baselines)."""
    return None if value is None else round(value, digits)


def plot(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(result["levels"], key=int)
    baselines = (
        ("in-process engine", "s", result["engine_output_tokens_per_s"]),
        ("aggregated cluster", "D", result["aggregated"]["output_tokens_per_s"]),
        ("HF generate, batched", "^", result["hf_batched_output_tokens_per_s"]),
        ("HF generate, one at a time", "v", result["hf_sequential_output_tokens_per_s"]),
    )
    x = [int(c) for c in levels]
    files = []
    for key, label in (("output_tokens_per_s", "output tokens/s"), ("ttft_p50_s", "TTFT p50 (s)"),
                       ("itl_p50_s", "inter-token latency p50 (s)")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(x, [result["levels"][c][key] for c in levels], marker="o", label="cluster")
        if key == "output_tokens_per_s":  # the baselines, measured at the headline level
            for name, marker, value in baselines:
                if value is None:
                    continue
                ax.plot([result["headline_concurrency"]], [value], marker, label=name)
            ax.legend(fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        path = out.with_name(f"{out.stem}-{key}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path.name)
    return files


def hf_baselines(llm: LLM, requests: list[Request], device: str, num_sequential: int,
                 repeats: int) -> tuple[float, float]:  # fmt: skip
    """HF generate tokens/s on the model the engine loaded: one request at a time, and batched."""
    hf = AutoModelForCausalLM.from_pretrained(
        llm.engine.model_dir, dtype=llm.engine.config.torch_dtype
    )
    hf = hf.to(device).eval()
    pad_id = llm.tokenizer.pad_token_id or 0
    sequential = requests[:num_sequential]
    hf_sequential = statistics.median(
        sum(r.max_tokens for r in sequential)
        / sum(r.max_tokens / hf_tokens_per_s(hf, [r], pad_id, device) for r in sequential)
        for _ in range(repeats)
    )
    hf_batched = statistics.median(
        hf_tokens_per_s(hf, requests, pad_id, device) for _ in range(repeats)
    )
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()  # give the memory back for the cluster's workers
    return hf_sequential, hf_batched


def profile_run(cluster: Cluster, model: str, requests: list[Request], concurrency: int,
                out: Path) -> dict:  # fmt: skip
    """One more run at `concurrency`, profiled (left out of the medians); py-spy's raw stacks go
    to <out>-profile/<process>.txt for flame graphs."""
    raw_dir = out.with_name(f"{out.stem}-profile")
    with ClusterProfile(cluster.process.pid, raw_dir) as profile:
        asyncio.run(run_clients(cluster.url, model, requests, concurrency))
    return profile.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-model", action="store_true", help="SmolLM2-135M-Instruct preset")
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--output-len", type=int, nargs=2, default=[64, 256])
    parser.add_argument("--hf-sequential-requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled extra run")
    parser.add_argument("--no-baselines", action="store_true", help="no in-process engine, no HF")
    parser.add_argument("--aggregated-levels", action="store_true",
                        help="every concurrency level on the aggregated cluster too")  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "bench/results/latest.json"))
    if "--real-model" in sys.argv[1:]:
        parser.set_defaults(**REAL_MODEL_PRESET)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the clusters on the way out
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompt_len, output_len = tuple(args.prompt_len), tuple(args.output_len)
    levels = sorted(set(args.concurrency))
    headline = HEADLINE_CONCURRENCY if HEADLINE_CONCURRENCY in levels else levels[-1]

    llm = None
    if args.no_baselines:
        from transformers import AutoTokenizer

        from engine.config import EngineConfig

        corpus = corpus_tokens(AutoTokenizer.from_pretrained(EngineConfig(args.model).model_dir()))
    else:
        llm = LLM(args.model, device=args.device, num_blocks=4096, max_num_seqs=headline,
                  dtype="bfloat16" if args.device == "cuda" else "float32")  # fmt: skip
        corpus = corpus_tokens(llm.tokenizer)

    def workload(concurrency: int, repeat: int) -> list[Request]:
        """Fresh prompts for every run: no run is served from an earlier one's prefix cache."""
        seed = args.seed + 1000 * repeat + concurrency
        return make_workload(corpus, max(2 * concurrency, 8), seed, prompt_len, output_len)

    hf_sequential = hf_batched = None
    if llm is not None:
        engine_tokens_per_s(llm, workload(headline, -1)[:4])  # warm-up
        hf_sequential, hf_batched = hf_baselines(
            llm, workload(headline, 0), args.device, args.hf_sequential_requests, args.repeats
        )

    workdir = Path(tempfile.mkdtemp(prefix="pdcluster-bench-"))
    result: dict = {"levels": {}}
    engine_runs, efficiencies = [], []
    cluster = Cluster(args.model, args.device, "disaggregated", workdir)
    try:
        asyncio.run(run_clients(cluster.url, args.model, workload(1, -1)[:2], 2))  # warm-up
        for c in levels:
            runs = []
            for repeat in range(args.repeats):
                requests = workload(c, repeat)
                runs.append(asyncio.run(run_clients(cluster.url, args.model, requests, c)))
                if c == headline and llm is not None:
                    # The engine on the same requests right after: this VM's speed drifts
                    # more between minutes than the two sides differ, so each pair is a ratio.
                    engine_runs.append(engine_tokens_per_s(llm, requests))
                    efficiencies.append(runs[-1]["output_tokens_per_s"] / engine_runs[-1])
            result["levels"][str(c)] = median_dict(runs)
            print(f"{c} clients: {result['levels'][str(c)]}", flush=True)
        result["prefix_ttft_ratio"] = round(
            prefix_ttft_ratio(cluster.url, args.model, corpus, args.repeats), 3
        )
        if not args.no_profile:
            result["profile"] = profile_run(
                cluster, args.model, workload(headline, args.repeats), headline, out
            )
    finally:
        cluster.stop()
    del llm  # the aggregated cluster needs the memory
    aggregated = Cluster(args.model, args.device, "aggregated", workdir)
    try:
        asyncio.run(run_clients(aggregated.url, args.model, workload(1, -1)[:2], 2))
        runs = [
            asyncio.run(run_clients(aggregated.url, args.model, workload(headline, r), headline))
            for r in range(args.repeats)
        ]
        result["aggregated"] = median_dict(runs)
        if args.aggregated_levels:
            result["aggregated_levels"] = {str(headline): result["aggregated"]}
            for c in levels:
                if c != headline:
                    runs = [
                        asyncio.run(run_clients(aggregated.url, args.model, workload(c, r), c))
                        for r in range(args.repeats)
                    ]
                    result["aggregated_levels"][str(c)] = median_dict(runs)
                print(f"aggregated, {c} clients: {result['aggregated_levels'][str(c)]}", flush=True)
    finally:
        aggregated.stop()

    cluster_tps = result["levels"][str(headline)]["output_tokens_per_s"]
    result.update(
        benchmark="serving",
        model=args.model,
        device=args.device,
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),  # the in-process engine's
        prompt_len=list(prompt_len),
        output_len=list(output_len),
        repeats=args.repeats,
        headline_concurrency=headline,
        engine_output_tokens_per_s=rounded(
            statistics.median(engine_runs) if engine_runs else None, 1
        ),
        hf_sequential_output_tokens_per_s=rounded(hf_sequential, 1),
        hf_batched_output_tokens_per_s=rounded(hf_batched, 1),
        pipeline_efficiency=rounded(statistics.median(efficiencies) if efficiencies else None, 3),
        pipeline_efficiency_runs=[round(e, 3) for e in efficiencies],
        vs_hf_sequential=rounded(hf_sequential and cluster_tps / hf_sequential, 2),
        vs_hf_batched=rounded(hf_batched and cluster_tps / hf_batched, 2),
        disagg_vs_agg=round(cluster_tps / result["aggregated"]["output_tokens_per_s"], 3),
    )
    result["plots"] = plot(result, out)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
