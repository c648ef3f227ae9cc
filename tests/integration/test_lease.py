"""A generation worker that comes too late for its KV: the context worker frees the leased blocks
at the deadline, and the late reader, instead of reading reused blocks, prefills the prompt
itself; requests queued for a decode slot longer than the lease complete the same way."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.harness import MODEL, Cluster, alive, wait_for

LEASE_S = 2.0
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster(
        "disaggregated",
        extra=f"transfer: {{lease_seconds: {LEASE_S}, pull_timeout_seconds: 1}}\n"
        f"generation_workers: {{max_num_seqs: {MAX_NUM_SEQS}}}\n",
        # a stopped (SIGSTOP) worker must not be declared dead meanwhile; every prompt handed
        # off (no deflection): the leases and their readers are what these tests are about
        orchestrator="router: round_robin, worker_timeout_seconds: 60, max_prefill_queue_size: 0",
    )


def leased(cluster: Cluster) -> int:
    return sum(w.blocks_leased for w in cluster.info().workers if w.role == "context")


def complete(cluster: Cluster, prompt: str, max_tokens: int = 4) -> str:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="x", timeout=60, max_retries=0)
    result = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return result.choices[0].text


def send_in_background(cluster: Cluster, prompt: str) -> tuple[threading.Thread, dict]:
    """A 4-token completion in a thread; the dict gets its text ("text"), or its HTTP error
    ("error") and when it came ("at")."""
    result: dict = {}

    def send() -> None:
        try:
            result["text"] = complete(cluster, prompt)
        except openai.APIStatusError as e:
            result["error"], result["at"] = e, time.monotonic()

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


def recomputed(cluster: Cluster) -> int:
    return sum(w.prompts_recomputed for w in cluster.info().workers if w.role == "generation")


def test_expired_lease_frees_blocks_and_the_late_reader_prefills_itself(cluster: Cluster) -> None:
    """The reader finds the DecodeRequest on its socket only after the lease it carries ended
    at the source: it counts the lease from before it could have arrived, not from when it was
    read, so it never reads the freed (maybe reused) blocks."""
    prompt = "Late reader " * 20
    gen_pid = next(w.pid for w in cluster.info().workers if w.worker_id == "gen-0")
    recomputed_before = recomputed(cluster)
    os.kill(gen_pid, signal.SIGSTOP)
    try:
        sender, result = send_in_background(cluster, prompt)
        wait_for(lambda: leased(cluster) > 0, 10)
        freed_after_s = wait_for(lambda: leased(cluster) == 0, LEASE_S + 5)
    finally:
        os.kill(gen_pid, signal.SIGCONT)
    sender.join(30)
    assert freed_after_s <= LEASE_S + 2
    assert result.get("text") == complete(cluster, prompt), result  # as if read in time
    wait_for(lambda: recomputed(cluster) > recomputed_before, 5)  # prefilled, not read
    assert_no_block_held(cluster)


def assert_no_block_held(cluster: Cluster) -> None:
    info = cluster.wait_idle(timeout_s=15)
    for worker in info.workers:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker


def test_twice_as_many_long_streams_as_decode_slots_all_complete(cluster: Cluster) -> None:
    """The integrity issue's third case: requests queued for a decode slot outlived the lease
    and failed (kv_transfer_failed); now their prompts are prefilled again where they decode."""
    prompts = [
        f"Stream {i} of many, each one long enough to queue. " * 3 for i in range(2 * MAX_NUM_SEQS)
    ]
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(cluster, p, max_tokens=400), prompts))
    assert all(texts)
    for prompt, text in list(zip(prompts, texts, strict=True))[-2:]:  # queued ones, as if alone
        assert text == complete(cluster, prompt, max_tokens=400)
    assert_no_block_held(cluster)


def test_context_worker_killed_after_prefill_before_the_pull(cluster: Cluster) -> None:
    """The reader finds its source gone (its READ fails, or the lease is over by then): the
    prompt is prefilled where it decodes, and the context worker comes back."""
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
    assert result.get("text") and time.monotonic() - resumed_at < 10.0, result
    wait_for(lambda: any(w.worker_id == "ctx-0" and w.pid != ctx_pid and w.state == "ready"
                         for w in cluster.info().workers), 30)  # fmt: skip
    assert complete(cluster, "Back again")
    assert_no_block_held(cluster)
