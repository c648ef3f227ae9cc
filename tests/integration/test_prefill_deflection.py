"""Load-aware prefill deflection (orchestrator.max_prefill_queue_size), from outside: with the
context worker frozen (SIGSTOP, within the worker timeout, so it still counts as up) the two
prompts queued there wait, and the next ones are prefilled by the generation worker and answered
with Hugging Face's greedy text instead of queueing behind them. Once the context worker resumes
the two queued prompts finish too, and no KV block or request entry is left anywhere. Both with
the queue size set (2) and with "auto", the default, whose extra condition (first tokens wait
longer than decodes take) a first prompt held behind the frozen worker meets."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from orchestrator.orchestrator import AUTO_PREFILL_QUEUE_SIZE
from tests.integration.harness import MODEL, Cluster, hf_greedy_texts, wait_for
from tests.integration.test_observability import metrics
from tools.tiny_model.build import TEST_PROMPTS

MAX_NEW = 16
QUEUE_SIZE = AUTO_PREFILL_QUEUE_SIZE  # "auto"'s: both settings queue as many
FROZEN_S = 2.0


@pytest.fixture(scope="module")
def hf_texts(tiny_model_path: Path) -> dict[str, str]:
    return hf_greedy_texts(tiny_model_path, TEST_PROMPTS, MAX_NEW)


@pytest.fixture(scope="module", params=[str(QUEUE_SIZE), "auto"])
def cluster(start_cluster, request: pytest.FixtureRequest) -> Cluster:
    # a frozen worker is dead only after a minute here: the test ends well before
    keys = f"router: kv_aware, worker_timeout_seconds: 60, max_prefill_queue_size: {request.param}"
    return start_cluster("disaggregated", orchestrator=keys)


def complete(cluster: Cluster, prompt: str) -> str:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=60, max_retries=0)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW,
                                       temperature=0)  # fmt: skip
    return answer.choices[0].text


def wait_heartbeat(cluster: Cluster, role: str) -> None:
    """Until each worker of `role` has sent its stats since this call: the orchestrator's view
    of its queue is then current."""
    start = time.monotonic()
    wait_for(lambda: all(w.last_heartbeat_s < time.monotonic() - start
                         for w in cluster.workers(role)), 10, f"{role} heartbeat")  # fmt: skip


def slow_first_token(cluster: Cluster, context_pid: int, hf_texts: dict[str, str]) -> None:
    """One prompt held behind the frozen context worker for FROZEN_S: its first token waits far
    longer than its decode takes, so "auto" deems the context side the bottleneck."""
    os.kill(context_pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        try:
            held = pool.submit(complete, cluster, TEST_PROMPTS[0])
            time.sleep(FROZEN_S)
        finally:
            os.kill(context_pid, signal.SIGCONT)
        assert held.result(timeout=60) == hf_texts[TEST_PROMPTS[0]]


def test_prompts_past_a_stuck_context_queue_are_prefilled_where_they_decode(
    cluster: Cluster, hf_texts: dict[str, str]
) -> None:
    (context,) = cluster.workers("context")
    slow_first_token(cluster, context.pid, hf_texts)
    (context,) = cluster.workers("context")
    (generation,) = cluster.workers("generation")
    deflected_before = generation.local_prefills_routed
    os.kill(context.pid, signal.SIGSTOP)
    pool = ThreadPoolExecutor(QUEUE_SIZE)
    try:
        queued = [pool.submit(complete, cluster, p) for p in TEST_PROMPTS[:QUEUE_SIZE]]
        target = context.requests_routed + QUEUE_SIZE
        wait_for(lambda: cluster.workers("context")[0].requests_routed == target, 10,
                 "queued at the context worker")  # fmt: skip
        # one at a time, each once the generation worker has reported its queue empty again
        deflected = TEST_PROMPTS[QUEUE_SIZE:]
        for prompt in deflected:
            wait_heartbeat(cluster, "generation")
            assert complete(cluster, prompt) == hf_texts[prompt], prompt
        assert not any(f.done() for f in queued)  # still behind the frozen worker
        routed = cluster.workers("generation")[0].local_prefills_routed
        assert routed - deflected_before == len(deflected)
        scraped = metrics(cluster)["pdcluster_local_prefills_total"]
        assert scraped[(generation.worker_id, "generation")] == routed
    finally:
        os.kill(context.pid, signal.SIGCONT)
        pool.shutdown(wait=False)
    for prompt, future in zip(TEST_PROMPTS, queued, strict=False):
        assert future.result(timeout=60) == hf_texts[prompt], prompt
    info = cluster.wait_idle()
    for worker in (w for w in info.workers if w.role in ("context", "generation")):
        assert (worker.blocks_used, worker.blocks_leased, worker.active_requests) == (0, 0, 0)
    assert info.num_requests == 0
