"""A generation worker that comes too late for its KV: the context worker frees the leased blocks
at the deadline, and the late reader fails the request instead of reading reused blocks."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from tests.integration.harness import MODEL, Cluster, alive

LEASE_S = 2.0


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster(
        "disaggregated",
        extra=f"transfer: {{lease_seconds: {LEASE_S}, pull_timeout_seconds: 1}}\n",
        # a stopped (SIGSTOP) worker must not be declared dead meanwhile
        orchestrator="router: round_robin, worker_timeout_seconds: 60",
    )


def leased(cluster: Cluster) -> int:
    return sum(w.blocks_leased for w in cluster.info().workers if w.role == "context")


def wait_for(condition, timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s
        time.sleep(0.05)
    return time.monotonic() - start


def send_in_background(cluster: Cluster, prompt: str) -> tuple[threading.Thread, dict]:
    """A 4-token completion in a thread; the dict gets its HTTP error ("error") and when it
    came ("at"), if it fails."""
    result: dict = {}

    def send() -> None:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="x", timeout=60, max_retries=0)
        try:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        except openai.APIStatusError as e:
            result["error"], result["at"] = e, time.monotonic()

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


def test_expired_lease_frees_blocks_and_the_late_reader_fails_the_request(cluster: Cluster) -> None:
    gen_pid = next(w.pid for w in cluster.info().workers if w.worker_id == "gen-0")
    os.kill(gen_pid, signal.SIGSTOP)
    try:
        sender, result = send_in_background(cluster, "Late reader " * 20)
        wait_for(lambda: leased(cluster) > 0, 10)
        freed_after_s = wait_for(lambda: leased(cluster) == 0, LEASE_S + 5)
    finally:
        os.kill(gen_pid, signal.SIGCONT)
    sender.join(30)
    assert freed_after_s <= LEASE_S + 2
    error = result.get("error")
    assert error is not None and error.status_code == 503 and "lease" in error.message, result
    info = cluster.wait_idle(timeout_s=15)
    for worker in info.workers:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker
    client = openai.OpenAI(base_url=cluster.base_url, api_key="x", timeout=60, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="On time", max_tokens=4).choices


def test_context_worker_killed_after_prefill_before_the_pull(cluster: Cluster) -> None:
    """The reader finds its source gone: the request fails with a clear error within 5 s and the
    context worker comes back."""
    workers = {w.worker_id: w for w in cluster.info().workers}
    gen_pid, ctx_pid = workers["gen-0"].pid, workers["ctx-0"].pid
    os.kill(gen_pid, signal.SIGSTOP)
    try:
        sender, result = send_in_background(cluster, "Orphaned blocks " * 20)
        wait_for(lambda: leased(cluster) > 0, 10)  # prefilled and handed off; not yet read
        os.kill(ctx_pid, signal.SIGKILL)
        wait_for(lambda: not alive(ctx_pid), 10)  # its memory is gone, not just signalled
    finally:
        resumed_at = time.monotonic()
        os.kill(gen_pid, signal.SIGCONT)
    sender.join(30)
    error = result.get("error")
    assert error is not None and error.status_code == 503, result
    assert result["at"] - resumed_at < 5.0
    wait_for(lambda: any(w.worker_id == "ctx-0" and w.pid != ctx_pid and w.state == "ready"
                         for w in cluster.info().workers), 30)  # fmt: skip
    client = openai.OpenAI(base_url=cluster.base_url, api_key="x", timeout=60, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Back again", max_tokens=4).choices
    info = cluster.wait_idle(timeout_s=15)
    for worker in info.workers:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker
