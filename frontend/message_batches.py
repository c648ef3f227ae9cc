"""Anthropic's Message Batches: /v1/messages/batches create, list, retrieve, cancel, results,
delete. Each request of a batch is a POST /v1/messages run with no client connection (the
seed's `no_client_connection`): no disconnect watcher, no HTTP task per request.

The frontend process that creates a batch runs it: at most `frontend.batch_concurrency`
requests at a time, at priority BATCH_PRIORITY (below interactive requests, so a saturated
cluster serves those first and sheds batch requests, which are retried). A request that fails
for the cluster's reasons (429, 5xx: a worker restarting, the cluster at capacity) is tried
again, with backoff, for up to RETRY_WINDOW_S; one the request itself makes fail (400) is an
`errored` result. State lives in the batch store (batch_store.py, beside stored responses), so
any frontend process answers for any batch, and a cancel sent to another process reaches the
runner through it (polled every CANCEL_POLL_S). A batch whose runner died (its frontend process
with it) ends at its `expires_at`: what it had not finished is `expired`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import time
import uuid
from typing import Literal

import msgspec

from common.errors import InvalidRequest
from common.protocol import Chunk, GenerateRequest, RequestFailed, encode
from frontend import anthropic
from frontend.batch_store import BatchRecord, BatchStore
from frontend.cluster_client import ClusterClient, Event
from frontend.generation import error_body_of, timed_out
from frontend.model_info import ModelInfo

logger = logging.getLogger(__name__)

BATCH_PRIORITY = -1  # below the default 0 of interactive requests
EXPIRY_S = 24 * 3600  # as Anthropic's
RETRY_WINDOW_S = 300.0  # a request failing for the cluster's reasons is retried this long
MAX_BACKOFF_S = 5.0
CANCEL_POLL_S = 0.5
MAX_REQUESTS = 100_000  # per batch, as Anthropic's
RETRYABLE = frozenset({429, 500, 502, 503, 504})
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class BatchItem(_Strict):
    custom_id: str
    params: anthropic.MessagesRequest


class CreateBatchRequest(_Strict):
    requests: list[BatchItem]


class RequestCounts(msgspec.Struct, kw_only=True):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: RequestCounts
    created_at: str
    expires_at: str
    ended_at: str | None = None
    cancel_initiated_at: str | None = None
    archived_at: str | None = None
    results_url: str | None = None  # once ended


class BatchList(msgspec.Struct, kw_only=True):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


def parse_items(body: CreateBatchRequest) -> list[tuple[str, bytes]]:
    """The requests as (custom id, params JSON), checked as Anthropic checks them at creation."""
    if not 1 <= len(body.requests) <= MAX_REQUESTS:
        raise InvalidRequest(f"a batch holds 1 to {MAX_REQUESTS} requests", "requests")
    seen: set[str] = set()
    for i, item in enumerate(body.requests):
        if not CUSTOM_ID.fullmatch(item.custom_id):
            raise InvalidRequest(
                "custom_id must be 1 to 64 letters, digits, '_' or '-'",
                f"requests[{i}].custom_id",
            )
        if item.custom_id in seen:
            raise InvalidRequest(
                f"custom_id {item.custom_id!r} is used twice", f"requests[{i}].custom_id"
            )
        seen.add(item.custom_id)
        if item.params.stream:
            raise InvalidRequest("a batch's requests cannot stream", f"requests[{i}].params.stream")
    return [(item.custom_id, msgspec.json.encode(item.params)) for item in body.requests]


def new_batch_id() -> str:
    return f"msgbatch_{uuid.uuid4().hex}"


def view(record: BatchRecord, base_url: str, now: float) -> MessageBatch:
    """What the API shows of a batch, derived from its stored state; past its expiry, an
    unfinished batch (its runner gone) shows as ended, what it had not done expired."""
    counts = RequestCounts()
    for result in record.results:
        kind = "processing" if result is None else msgspec.json.decode(result)["result"]["type"]
        setattr(counts, kind, getattr(counts, kind) + 1)
    expires_at = record.created_at + EXPIRY_S
    ended_at = ended_at_of(record, now)
    if record.ended_at is None and ended_at is not None:  # expired
        counts.expired, counts.processing = counts.processing, 0
    if ended_at is not None:
        status: Literal["in_progress", "canceling", "ended"] = "ended"
    else:
        status = "in_progress" if record.cancel_initiated_at is None else "canceling"
    return MessageBatch(
        id=record.id,
        processing_status=status,
        request_counts=counts,
        created_at=_rfc3339(record.created_at),
        expires_at=_rfc3339(expires_at),
        ended_at=None if ended_at is None else _rfc3339(ended_at),
        cancel_initiated_at=(
            None if record.cancel_initiated_at is None else _rfc3339(record.cancel_initiated_at)
        ),
        results_url=f"{base_url}v1/messages/batches/{record.id}/results" if ended_at else None,
    )


def ended_at_of(record: BatchRecord, now: float) -> float | None:
    """When the batch ended: by itself, or, its runner gone, at its expiry; None: running."""
    expires_at = record.created_at + EXPIRY_S
    if record.ended_at is None and now >= expires_at:
        return expires_at
    return record.ended_at


def results_jsonl(record: BatchRecord, items: list[tuple[str, bytes]]) -> bytes:
    """One line per request, in request order: its result, or `expired` if it has none."""
    lines = []
    for (custom_id, _), result in zip(items, record.results, strict=True):
        line = result or msgspec.json.encode(_line(custom_id, {"type": "expired"}))
        lines.append(line + b"\n")
    return b"".join(lines)


def page(batches: list[MessageBatch], limit: int, after_id: str | None, before_id: str | None
         ) -> BatchList:  # fmt: skip
    """Anthropic's list: newest first, `limit` at a time, after or before a batch id."""
    ids = [b.id for b in batches]
    start, end = 0, len(batches)
    if after_id is not None:
        start = ids.index(after_id) + 1 if after_id in ids else len(ids)
    if before_id is not None:
        end = ids.index(before_id) if before_id in ids else 0
        start = max(start, end - limit)
    chosen = batches[start : min(end, start + limit)]
    has_more = (start + limit < end) if before_id is None else start > 0
    return BatchList(
        data=chosen,
        has_more=has_more,
        first_id=chosen[0].id if chosen else None,
        last_id=chosen[-1].id if chosen else None,
    )


def _line(custom_id: str, result: dict[str, object]) -> dict[str, object]:
    return {"custom_id": custom_id, "result": result}


def _rfc3339(instant: float) -> str:
    return datetime.datetime.fromtimestamp(instant, datetime.UTC).isoformat().replace("+00:00", "Z")


class BatchRunner:
    """Runs this process's batches as asyncio tasks (the store's calls and the requests'
    translation in threads, off the event loop)."""

    def __init__(
        self,
        store: BatchStore,
        client: ClusterClient,
        model: ModelInfo,
        concurrency: int,
        request_timeout_s: float,
    ) -> None:
        self.store = store
        self.client = client
        self.model = model
        self.concurrency = concurrency
        self.request_timeout_s = request_timeout_s
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self, batch_id: str, items: list[tuple[str, bytes]]) -> None:
        task = asyncio.create_task(self._run(batch_id, items))
        self.tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _run(self, batch_id: str, items: list[tuple[str, bytes]]) -> None:
        canceled = asyncio.Event()
        watcher = asyncio.create_task(self._watch_cancel(batch_id, canceled))
        pending = iter(enumerate(items))  # shared by the workers: each request taken once

        async def worker() -> None:
            for position, (custom_id, params) in pending:
                result: dict[str, object] = (
                    {"type": "canceled"}
                    if canceled.is_set()
                    else await self._answer(params, canceled)
                )
                line = msgspec.json.encode(_line(custom_id, result))
                await asyncio.to_thread(self.store.put_result, batch_id, position, line)

        try:
            await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(items)))))
            await asyncio.to_thread(self.store.end, batch_id, time.time())
        except Exception:
            logger.exception("%s: the batch's runner failed; it ends at its expiry", batch_id)
        finally:
            watcher.cancel()

    async def _watch_cancel(self, batch_id: str, canceled: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            if await asyncio.to_thread(self.store.cancel_requested, batch_id):
                canceled.set()
                return

    async def _answer(self, params: bytes, canceled: asyncio.Event) -> dict[str, object]:
        """One request's result: succeeded (the message), errored (the error), or canceled."""
        deadline = time.monotonic() + RETRY_WINDOW_S
        backoff_s = 0.25
        while True:
            try:
                body = msgspec.json.decode(params, type=anthropic.MessagesRequest)
                generate = await asyncio.to_thread(
                    anthropic.to_generate_request, body, self.model, self.client.reply_to
                )
                encode(generate)
            except InvalidRequest as e:
                return _errored(RequestFailed(request_id="", status_code=400, message=str(e)))
            except (ValueError, OverflowError, RecursionError) as e:
                message = f"the request cannot be served: {e}"
                return _errored(RequestFailed(request_id="", status_code=400, message=message))
            generate.priority = BATCH_PRIORITY
            event = await self._once(generate, canceled)
            if event is None:
                return {"type": "canceled"}
            if isinstance(event, Chunk) and event.status_code == 200:
                return {"type": "succeeded", "message": msgspec.json.decode(event.data)}
            if event.status_code not in RETRYABLE or time.monotonic() + backoff_s > deadline:
                return _errored(event)
            logger.info("batch request %s failed (%d); trying again in %.2f s",
                        generate.request_id, event.status_code, backoff_s)  # fmt: skip
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, MAX_BACKOFF_S)

    async def _once(self, generate: GenerateRequest, canceled: asyncio.Event) -> Event | None:
        """Submit and wait for the answer (a non-streamed request's one chunk, or its failure);
        None if the batch is canceled first (the request is aborted)."""
        request_id = generate.request_id
        queue = await self.client.submit(generate)
        answer = asyncio.ensure_future(queue.get())
        cancel = asyncio.ensure_future(canceled.wait())
        done, _ = await asyncio.wait(
            {answer, cancel}, timeout=self.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        answer.cancel()
        cancel.cancel()
        if answer in done:
            self.client.done(request_id)
            return answer.result()
        self.client.abort(request_id)
        return None if cancel in done else timed_out(request_id, self.request_timeout_s)


def _errored(event: Event) -> dict[str, object]:
    return {"type": "errored", "error": msgspec.json.decode(error_body_of(event, "anthropic"))}
