"""`priority` under a saturating load, across the hand-off: a disaggregated cluster whose context
worker prefills one request at a time, in small chunks, so that requests queue there; the ones
sent later with a higher priority jump that queue (the scheduler's priority order) and their
first tokens come back well before those of the earlier low-priority requests."""

from __future__ import annotations

import asyncio
import statistics
import time

import openai
import pytest

from tests.integration.harness import MODEL, Cluster

NUM_LOW, NUM_HIGH = 24, 4
SENT_APART_S = 0.1
PROMPT = "the river and the harbour and the traders and the salt " * 12  # ~120 tokens


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    extra = (
        "context_workers: {max_num_seqs: 1, max_num_batched_tokens: 8}\n"
        "generation_workers: {max_num_seqs: 4}\n"
    )
    return start_cluster("disaggregated", extra=extra)


async def first_token_s(client: openai.AsyncOpenAI, priority: int, tag: int) -> float:
    start = time.monotonic()
    stream = await client.completions.create(
        model=MODEL, prompt=f"{tag} {PROMPT}", max_tokens=4, temperature=0, stream=True,
        extra_body={"priority": priority},
    )  # fmt: skip
    first = None
    async for _ in stream:
        first = first or time.monotonic() - start
    assert first is not None
    return first


async def saturate(cluster: Cluster) -> tuple[list[float], list[float]]:
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="-", timeout=120, max_retries=0)
    low = [asyncio.create_task(first_token_s(client, 0, i)) for i in range(NUM_LOW)]
    await asyncio.sleep(SENT_APART_S)  # the low ones queue at the context worker first
    high = [asyncio.create_task(first_token_s(client, 10, NUM_LOW + i)) for i in range(NUM_HIGH)]
    return list(await asyncio.gather(*low)), list(await asyncio.gather(*high))


def test_higher_priority_requests_sent_later_get_their_first_token_sooner(cluster: Cluster) -> None:
    low, high = asyncio.run(asyncio.wait_for(saturate(cluster), 180))
    ratio = statistics.median(high) / statistics.median(low)
    print(f"TTFT p50: high {statistics.median(high):.3f} s, low {statistics.median(low):.3f} s, "
          f"ratio {ratio:.2f}")  # fmt: skip
    # Order, not speed: each high-priority request (sent after the low ones) saw its first
    # token before most of the low-priority requests that were queued ahead of it (without the
    # priority order, all of them).
    low_firsts = sorted(low)
    for ttft in high:
        assert sum(t < ttft + SENT_APART_S for t in low_firsts) <= NUM_LOW // 2, (high, low)
    info = cluster.wait_idle(timeout_s=30)
    assert info.num_requests == 0
