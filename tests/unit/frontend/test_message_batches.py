"""Message Batches without a cluster: the store in both backends (SQLite, a real redis-server),
what the API shows of a stored batch (counts, status, expiry), the list's pages, the results'
lines, and the checks at creation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from common.errors import InvalidRequest
from frontend.batch_store import BatchRecord, BatchStore, open_batch_store
from frontend.message_batches import (
    EXPIRY_S,
    CreateBatchRequest,
    page,
    parse_items,
    results_jsonl,
    view,
)
from tests.redis_server import redis_server

BASE = "http://frontend:8000/"
SUCCEEDED = b'{"custom_id":"a","result":{"type":"succeeded","message":{}}}'
CANCELED = b'{"custom_id":"b","result":{"type":"canceled"}}'


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BatchStore]:
    if request.param == "sqlite":
        yield open_batch_store(str(tmp_path / "store.sqlite3"))
    else:
        with redis_server() as url:
            yield open_batch_store(url)


def test_a_batch_is_stored_with_its_requests_results_and_instants(store: BatchStore) -> None:
    items = [("a", b'{"x":1}'), ("b", b'{"x":2}'), ("c", b'{"x":3}')]
    store.create("msgbatch_1", 100.0, items)
    store.create("msgbatch_2", 200.0, items[:1])
    assert store.ids() == ["msgbatch_2", "msgbatch_1"]
    assert store.params("msgbatch_1") == items
    store.put_result("msgbatch_1", 1, CANCELED)
    assert not store.cancel_requested("msgbatch_1")
    store.cancel("msgbatch_1", 150.0)
    assert store.cancel_requested("msgbatch_1") and store.cancel_requested("msgbatch_9")
    store.cancel("msgbatch_1", 160.0)  # the first request counts
    store.end("msgbatch_1", 170.0)
    assert store.get("msgbatch_1") == BatchRecord(
        "msgbatch_1", 100.0, 150.0, 170.0, [None, CANCELED, None]
    )
    store.delete("msgbatch_1")
    assert store.get("msgbatch_1") is None and store.ids() == ["msgbatch_2"]


def test_the_view_counts_results_and_ends_an_abandoned_batch_at_its_expiry() -> None:
    record = BatchRecord("msgbatch_1", 0.0, None, None, [SUCCEEDED, None, CANCELED])
    running = view(record, BASE, now=10.0)
    assert running.processing_status == "in_progress" and running.results_url is None
    assert msgspec.structs.asdict(running.request_counts) == {
        "processing": 1, "succeeded": 1, "errored": 0, "canceled": 1, "expired": 0
    }  # fmt: skip
    assert running.created_at == "1970-01-01T00:00:00Z"
    record.cancel_initiated_at = 5.0
    assert view(record, BASE, now=10.0).processing_status == "canceling"
    expired = view(record, BASE, now=EXPIRY_S + 1)  # its runner is gone: it never ended itself
    assert expired.processing_status == "ended" and expired.ended_at == expired.expires_at
    assert expired.request_counts.expired == 1 and expired.request_counts.processing == 0
    assert expired.results_url == f"{BASE}v1/messages/batches/msgbatch_1/results"
    lines = results_jsonl(record, [("a", b""), ("x", b""), ("b", b"")]).splitlines()
    assert lines == [SUCCEEDED, b'{"custom_id":"x","result":{"type":"expired"}}', CANCELED]


def test_the_list_pages_newest_first() -> None:
    batches = [view(BatchRecord(f"b{i}", float(-i), None, None, []), BASE, 0.0) for i in range(5)]

    def ids(limit: int, after: str | None = None, before: str | None = None) -> tuple:
        listed = page(batches, limit, after, before)
        return [b.id for b in listed.data], listed.has_more, listed.first_id, listed.last_id

    assert ids(2) == (["b0", "b1"], True, "b0", "b1")
    assert ids(2, after="b1") == (["b2", "b3"], True, "b2", "b3")
    assert ids(2, after="b3") == (["b4"], False, "b4", "b4")
    assert ids(2, before="b4") == (["b2", "b3"], True, "b2", "b3")
    assert ids(2, before="b1") == (["b0"], False, "b0", "b0")
    assert ids(10, after="nope") == ([], False, None, None)


@pytest.mark.parametrize(
    ("requests", "param"),
    [
        ([], "requests"),
        ([("a", False), ("a", False)], "requests[1].custom_id"),
        ([("a" * 65, False)], "requests[0].custom_id"),
        ([("é", False)], "requests[0].custom_id"),
        ([("a", True)], "requests[0].params.stream"),
    ],
)
def test_bad_batches_are_refused_at_creation(requests: list, param: str) -> None:
    body = {"requests": [
        {"custom_id": custom_id, "params": {"model": "m", "max_tokens": 4, "stream": stream,
                                            "messages": [{"role": "user", "content": "hi"}]}}
        for custom_id, stream in requests
    ]}  # fmt: skip
    with pytest.raises(InvalidRequest) as refused:
        parse_items(msgspec.json.decode(msgspec.json.encode(body), type=CreateBatchRequest))
    assert refused.value.param == param
