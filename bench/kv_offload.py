"""The KV offload tier through a real cluster: a multi-turn workload whose working set is about 4x
the device pool, with `kv_cache.offload` off and on.

Conversations are taken in turns, round robin, one request at a time: each turn's prompt is the
conversation so far (every earlier prompt and greedy answer) plus a new user turn of random token
ids, so between two turns of one conversation the other conversations' turns push its blocks out
of every engine worker's pool. Settings: the tier off; a host tier holding the whole working set;
a host tier as small as the pool with a disk tier behind it; and, with two context workers and
the round_robin router, the tier off and on (each worker reads the other's host tier over NIXL).
Reported per setting: TTFT p50 / p90 (streamed, to the first chunk), the prompt tokens the engine
workers ran through the model (WorkerInfo.prompt_tokens_computed, context and generation workers
together), whether any block is still used or leased once idle, and the blocks read from a peer's
host tier. The answers of the settings are compared token for token.

    .venv/bin/python -m bench.kv_offload [--model builtin:smollm2-135m] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx
import msgspec

from bench.serving import free_port
from common.protocol import ClusterInfo
from launcher.run import SERVING

ROOT = Path(__file__).resolve().parents[1]
PEER_READ = " prompt blocks read from "  # context_worker/worker.py's log line
BLOCK_SIZE = 16
TOKEN_RANGE = (100, 1000)  # random user-turn ids: ordinary tokens in every supported vocabulary


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 8
    turns: int = 4
    turn_tokens: int = 48
    max_tokens: int = 16
    num_blocks: int = 32  # each engine worker's pool
    seed: int = 0

    @property
    def working_set_blocks(self) -> int:
        """Every conversation's final length, in blocks, all together."""
        per_turn = self.turn_tokens + self.max_tokens
        return self.conversations * (self.turns * per_turn // BLOCK_SIZE)


@dataclass(slots=True)
class Run:
    prompts: list[list[int]]
    answers: list[list[int]]
    ttfts_s: list[float]


def block_num_bytes(model: str) -> int:
    """One KV block's bytes for the model in float32 (the cluster's default dtype)."""
    from engine.builtin_build import ensure_builtin  # torch: only where the bench needs it
    from engine.models import read_model_config

    config = read_model_config(ensure_builtin(model, "float32"))
    return config.num_layers * 2 * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 4


def offload_yaml(workload: Workload, host_bytes: int, disk_path: str | None = None) -> str:
    """The kv_cache keys (inside its braces) of one setting; host_bytes 0: the tier off."""
    keys = f"num_blocks: {workload.num_blocks}"
    if host_bytes:
        disk = f", disk_path: {disk_path}, disk_bytes: {4 * host_bytes}" if disk_path else ""
        keys += f", offload: {{host_bytes: {host_bytes}{disk}}}"
    return keys


def stream_completion(client: httpx.Client, model: str, prompt: list[int], max_tokens: int):
    """(TTFT, generated token ids) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    token_ids: list[int] = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            if first is None:
                first = time.perf_counter()
            token_ids += choice.get("token_ids") or []
    if first is None or len(token_ids) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {len(token_ids)}")
    return first - start, token_ids


def run_multi_turn(url: str, model: str, workload: Workload) -> Run:
    rng = random.Random(workload.seed)
    history: list[list[int]] = [[] for _ in range(workload.conversations)]
    run = Run([], [], [])
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(workload.turns):
            for conversation in history:
                conversation += [rng.randrange(*TOKEN_RANGE) for _ in range(workload.turn_tokens)]
                ttft, answer = stream_completion(
                    client, model, list(conversation), workload.max_tokens
                )
                run.prompts.append(list(conversation))
                conversation += answer
                run.answers.append(answer)
                run.ttfts_s.append(ttft)
    return run


def cluster_info(url: str) -> ClusterInfo:
    response = httpx.get(f"{url}/cluster_info", timeout=5)
    response.raise_for_status()
    return msgspec.json.decode(response.content, type=ClusterInfo)


def wait_idle_info(url: str, timeout_s: float = 15.0) -> ClusterInfo:
    """The table once no worker reports a request or a used or leased block (or at the timeout),
    after two heartbeat periods so that the figures are the final ones."""
    time.sleep(2.5)
    deadline = time.monotonic() + timeout_s
    while True:
        info = cluster_info(url)
        busy = [w for w in info.workers if w.blocks_used or w.blocks_leased or w.active_requests]
        if not busy or time.monotonic() > deadline:
            return info
        time.sleep(0.3)


def summarize(run: Run, info: ClusterInfo) -> dict[str, object]:
    engines = [w for w in info.workers if w.role in ("context", "generation")]
    ttfts = sorted(run.ttfts_s)
    return {
        "requests": len(run.ttfts_s),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
        "prompt_tokens_computed": sum(w.prompt_tokens_computed for w in engines),
        "prompt_tokens_computed_by_role": {
            role: sum(w.prompt_tokens_computed for w in engines if w.role == role)
            for role in ("context", "generation")
        },
        "blocks_used_after": sum(w.blocks_used for w in engines),
        "blocks_leased_after": sum(w.blocks_leased for w in engines),
    }


class BenchCluster:
    """`orchestrator up` (disaggregated unless `mode` says) on free loopback ports; stopped with
    SIGTERM. `extra`: more top-level cluster.yaml lines (bench/spec_decode.py's speculative, the
    peers setting's context workers); `router`: the orchestrator's."""

    def __init__(
        self, model: str, kv_cache: str, workdir: Path, name: str,
        mode: str = "disaggregated", extra: str = "", router: str = "kv_aware",
    ) -> None:  # fmt: skip
        port = free_port()
        config = workdir / f"{name}.yaml"
        config.write_text(
            f"model: {model}\nmode: {mode}\nfrontend: {{port: {port}}}\n"
            f'orchestrator: {{address: "tcp://127.0.0.1:{free_port()}", router: {router}}}\n'
            f"kv_cache: {{block_size: {BLOCK_SIZE}, {kv_cache}}}\n{extra}"
        )
        self.log_path = workdir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cli", "up", str(config)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while SERVING not in self.log_path.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the cluster did not start; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)


def measure(
    model: str, workload: Workload, kv_cache: str, workdir: Path, name: str, **cluster: str
) -> tuple[Run, dict[str, object]]:
    """One setting's cluster, run and figures; `cluster`: BenchCluster's extra and router."""
    bench_cluster = BenchCluster(model, kv_cache, workdir, name, **cluster)
    try:
        run = run_multi_turn(bench_cluster.url, model, workload)
        figures = summarize(run, wait_idle_info(bench_cluster.url))
    finally:
        bench_cluster.stop()
    figures["peer_tier_blocks_read"] = sum(
        int(line.split(PEER_READ)[0].split()[-1])
        for line in bench_cluster.log_path.read_text(errors="replace").splitlines()
        if PEER_READ in line
    )
    return run, figures


def peers_results(model: str, host_bytes: int, workdir: Path) -> dict[str, object]:
    """Two context workers, round robin, 7 conversations: a conversation's turns alternate
    between the workers, so its history was last computed on the other one; with the tier on,
    that worker's host tier is read over NIXL (engine/kv_tier_share.py)."""
    workload = Workload(conversations=7, turns=4)
    cluster = {"extra": "context_workers: {count: 2}\n", "router": "round_robin"}
    results: dict[str, object] = {
        "workload": asdict(workload) | {"working_set_blocks": workload.working_set_blocks},
        "cluster": "2 context workers, 1 generation worker, router round_robin",
    }
    answers = []
    for name, kv_cache in (
        ("off", offload_yaml(workload, 0)),
        ("host_tier", offload_yaml(workload, host_bytes)),
    ):
        run, results[name] = measure(model, workload, kv_cache, workdir, f"peers-{name}", **cluster)
        results[name]["kv_cache"] = kv_cache  # type: ignore[index]
        answers.append(run.answers)
    results["answers_identical"] = answers[0] == answers[1]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument(
        "--host-blocks", type=int, default=256, help="the host tier's size in blocks"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/kv_offload.json")
    args = parser.parse_args()
    workload = Workload()
    results: dict[str, object] = {
        "host": {"machine": platform.machine()},
        "model": args.model,
        "workload": asdict(workload) | {"working_set_blocks": workload.working_set_blocks},
        "block_size": BLOCK_SIZE,
    }
    block_bytes = block_num_bytes(args.model)
    host_bytes = args.host_blocks * block_bytes
    small_host = workload.num_blocks * block_bytes  # as big as the pool; the disk the rest
    with TemporaryDirectory() as tmp:
        settings = {
            "off": offload_yaml(workload, 0),
            "host_tier": offload_yaml(workload, host_bytes),
            "host_and_disk_tier": offload_yaml(workload, small_host, f"{tmp}/disk"),
        }
        answers = {}
        for name, kv_cache in settings.items():
            run, results[name] = measure(args.model, workload, kv_cache, Path(tmp), name)
            results[name]["kv_cache"] = kv_cache.replace(tmp, "$TMP")  # type: ignore[index]
            answers[name] = run.answers
        results["answers_identical"] = all(a == answers["off"] for a in answers.values())
        results["two_context_workers"] = peers_results(args.model, host_bytes, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
