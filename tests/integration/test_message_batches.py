"""Anthropic's Message Batches through the official `anthropic` SDK, on a disaggregated cluster
with two frontend processes (a batch runs in the one that created it; any answers for it): a
batch of 100 outlives a generation worker killed mid-batch with every result present, a cancel
ends a batch early. (Bad batches get Anthropic's errors, and a running batch refuses results and
delete, without a cluster: tests/unit/frontend/test_anthropic_routes.py.)"""

from __future__ import annotations

import os
import signal
import time

import anthropic
import pytest

from tests.integration.harness import MODEL, Cluster

ASK = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def cluster(start_cluster, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    store = tmp_path_factory.mktemp("store") / "store.sqlite3"
    return start_cluster("disaggregated", frontend=f'processes: 2, responses_store: "{store}"')


def client(cluster: Cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=60)


def params(i: int, max_tokens: int = 6, **extra: object) -> dict:
    messages = [{"role": "user", "content": f"Question {i}: tell me about the river."}]
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "messages": messages,
            **extra}  # fmt: skip


def wait_ended(cluster: Cluster, batch_id: str, timeout_s: float = 240.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client(cluster).messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.5)
    raise AssertionError(f"{batch_id} did not end in {timeout_s} s:\n{cluster.log_tail()}")


def test_a_batch_of_100_survives_a_generation_worker_killed_mid_batch(cluster: Cluster) -> None:
    requests = [{"custom_id": f"q-{i}", "params": params(i)} for i in range(99)]
    requests.insert(50, {"custom_id": "bad", "params": params(0, temperature=2.0)})
    batch = client(cluster).messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 100
    (generation,) = cluster.workers("generation")
    while client(cluster).messages.batches.retrieve(batch.id).request_counts.succeeded < 10:
        time.sleep(0.05)
    os.kill(generation.pid, signal.SIGKILL)  # its requests fail; the batch tries them again
    assert client(cluster).messages.batches.retrieve(batch.id).request_counts.processing > 0
    ended = wait_ended(cluster, batch.id)
    assert ended.request_counts.succeeded == 99 and ended.request_counts.errored == 1
    assert ended.results_url is not None and ended.ended_at is not None
    results = list(client(cluster).messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == [r["custom_id"] for r in requests]
    bad = results[50].result
    assert bad.type == "errored" and "temperature" in bad.error.error.message
    (restarted,) = cluster.workers("generation")
    assert restarted.pid != generation.pid
    assert "trying again" in cluster.log_tail(None)  # the killed worker's requests were retried
    # each answer is the one the same request gets on its own
    for result, request in [(results[i], requests[i]) for i in (0, 49, 99)]:
        assert result.result.type == "succeeded"
        fields = dict(request["params"])
        extra = {"temperature": fields.pop("temperature")}  # this SDK takes it as an extra
        alone = client(cluster).messages.create(**fields, extra_body=extra)
        assert result.result.message.content[0].text == alone.content[0].text
        assert result.result.message.usage.output_tokens == 6
    info = cluster.wait_idle(30)
    assert all(w.blocks_used == 0 and w.blocks_leased == 0 for w in info.workers)
    assert info.num_requests == 0


def test_cancel_ends_a_batch_early_and_the_list_shows_it(cluster: Cluster) -> None:
    sdk = client(cluster)
    # more requests than the runner finishes in one cancel poll, however fast the engine gets
    requests = [{"custom_id": f"c-{i}", "params": params(i, 64)} for i in range(400)]
    batch = sdk.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    canceling = sdk.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended")
    assert canceling.cancel_initiated_at is not None
    ended = wait_ended(cluster, batch.id, 60)
    counts = ended.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.canceled == 400
    results = list(sdk.messages.batches.results(batch.id))
    assert {r.result.type for r in results} <= {"succeeded", "canceled"}
    assert sum(r.result.type == "canceled" for r in results) == counts.canceled
    newest = sdk.messages.batches.list(limit=1)
    assert [b.id for b in newest.data] == [batch.id] and newest.has_more
    older = sdk.messages.batches.list(limit=5, after_id=batch.id)
    assert batch.id not in [b.id for b in older.data] and older.data
    info = cluster.wait_idle(30)
    assert all(w.blocks_used == 0 for w in info.workers) and info.num_requests == 0
    sdk.messages.batches.delete(batch.id)
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve(batch.id)
