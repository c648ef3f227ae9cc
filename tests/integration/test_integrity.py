"""Cluster integrity: a worker that was only slow or stopped for a while never wedges the cluster,
and a long engine step is not mistaken for death (each case failed on the code before the
integrity work: permanent 503s behind a green /health, workers declared dead mid-prefill)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.integration.harness import MODEL, Cluster

WORKER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster(
        "disaggregated",
        # one step prefills everything queued: a few long prompts make it last seconds
        extra="context_workers: {max_num_batched_tokens: 8192}\n",
        orchestrator=f"router: round_robin, worker_timeout_seconds: {WORKER_TIMEOUT_S}, "
        "heartbeat_interval_seconds: 0.2",
    )


def complete(cluster: Cluster, prompt: str, max_tokens: int = 4) -> str:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="x", timeout=120, max_retries=0)
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return result.choices[0].text


def worker(cluster: Cluster, worker_id: str):
    return next(w for w in cluster.info().workers if w.worker_id == worker_id)


def test_a_context_worker_stopped_past_the_timeout_serves_again(cluster: Cluster) -> None:
    """SIGSTOP past the worker timeout: declared dead, dropped from the generation worker's
    peers; when it resumes, the peers converge again and requests are served through it."""
    ctx = worker(cluster, "ctx-0")
    os.kill(ctx.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while worker(cluster, "ctx-0").state != "dead":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{cluster.url}/health", timeout=5).status_code == 503
    finally:
        os.kill(ctx.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while httpx.get(f"{cluster.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pulled_before = worker(cluster, "gen-0").kv_bytes_pulled
    for i in range(5):
        assert complete(cluster, f"Back from a stop, request {i}. " * 8)
    time.sleep(0.5)  # the next heartbeat carries the stats
    assert worker(cluster, "gen-0").kv_bytes_pulled > pulled_before  # read from ctx-0 again
    assert worker(cluster, "ctx-0").pid == ctx.pid  # the same process: nothing restarted


def test_a_step_longer_than_the_worker_timeout_is_not_death(cluster: Cluster) -> None:
    """Heartbeats come from their own thread: a prefill step of seconds leaves the worker
    alive (its progress age says how long the step has run), and every request succeeds."""
    prompts = [f"Long prompt number {i}, " + "with many many words " * 300 for i in range(4)]
    log_start = len(cluster.log_tail(num_chars=None))
    seen_age = 0.0
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, cluster, p) for p in prompts]
        while not all(f.done() for f in futures):
            ctx = worker(cluster, "ctx-0")
            assert ctx.state == "ready", ctx
            seen_age = max(seen_age, ctx.progress_age_s)
            time.sleep(0.1)
        assert all(f.result() for f in futures)
    assert seen_age > WORKER_TIMEOUT_S  # the scenario happened: one step outlasted the timeout
    assert "missed its heartbeats" not in cluster.log_tail(num_chars=None)[log_start:]
