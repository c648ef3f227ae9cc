"""Hand GenerateRequests to the cluster and turn what comes back into HTTP responses.

One request: relay the postproc worker's bytes (the whole JSON body, or SSE frames) untouched.
Several (a completions request with a list of prompts, an embeddings request with a list of
inputs): each sub-request's choices already carry their final index and the client's response id
(OutputOptions.index_offset / response_id), so the streams are interleaved as they come. Usage
travels as numbers on each sub-request's ending Chunk and is summed here: a fanned-out stream's
sub-requests end with no usage chunk and no [DONE] of their own (OutputOptions.fanned_out), and
the frontend writes the response's one ending. Non-streaming bodies are decoded for their
choices (vectors), which only they hold, and merged in order, with the summed usage.

The client going away before its answer aborts every sub-request (the blocks are freed on every
worker); so does a failure of any one of them, and so does the request's deadline
(`frontend.request_timeout_seconds`): a 504 before the first bytes, a final error event after.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from common.errors import anthropic_error_body, as_anthropic_error, error_body
from common.openai_schema import (
    Completion,
    EmbeddingList,
    EmbeddingUsage,
    PromptTokensDetails,
    Usage,
)
from common.protocol import Chunk, GenerateRequest, OutputOptions, RequestFailed
from common.stage_times import StageTimes
from frontend import metrics
from frontend.cluster_client import ClusterClient, Event

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


RETRY_AFTER_S = 1  # what a 429 / 503 tells clients (and the openai SDK honours)


def error_response(
    status_code: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    media: str = "openai",
) -> Response:
    """The one error shape of the API (`media`: "openai", or "anthropic" on /v1/messages)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status_code in (429, 503) else None
    if media == "anthropic":
        body = anthropic_error_body(status_code, message)
    else:
        body = error_body(status_code, message, param, code)
    return Response(body, status_code, headers=headers, media_type="application/json")


def error_body_of(event: Event, media: str) -> bytes:
    """A failure event's error body in the API's shape."""
    if isinstance(event, RequestFailed):
        if media == "anthropic":
            return anthropic_error_body(event.status_code, event.message)
        return error_body(event.status_code, event.message, event.param, event.code)
    return as_anthropic_error(event.data, event.status_code) if media == "anthropic" else event.data


def failure_response(event: Event, media: str = "openai") -> Response | None:
    """The HTTP error an event stands for, or None when it is a normal chunk."""
    if isinstance(event, RequestFailed) or event.status_code != 200:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if event.status_code in (429, 503) else None
        return Response(
            error_body_of(event, media), event.status_code, headers=headers,
            media_type="application/json",
        )  # fmt: skip
    return None


def error_frame(event: Event, media: str) -> bytes:
    """A failure after the stream started: a final error event (and [DONE] for OpenAI)."""
    body = error_body_of(event, media)
    if media == "anthropic":
        return b"event: error\ndata: " + body + b"\n\n"
    if media == "responses":  # the Responses API's error event: the error's fields, typed
        detail = msgspec.json.decode(body)["error"]
        event_body = {"type": "error", "code": detail["code"], "message": detail["message"],
                      "param": detail["param"], "sequence_number": 0}  # fmt: skip
        return b"event: error\ndata: " + msgspec.json.encode(event_body) + b"\n\n"
    return b"data: " + body + b"\n\n" + SSE_DONE


def timed_out(request_id: str, timeout_s: float) -> RequestFailed:
    message = (
        f"the request did not finish within {timeout_s:g} s (frontend.request_timeout_seconds)"
    )
    return RequestFailed(request_id=request_id, status_code=504, message=message, code="timeout")


async def serve(
    request: Request,
    client: ClusterClient,
    generates: list[GenerateRequest],
    media: str = "openai",
    timeout_s: float = 600.0,
) -> Response:
    """Submit, wait for the first events, and answer: an HTTP error, a body, or a stream."""
    ids = [g.request_id for g in generates]
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    queues = [await client.submit(g) for g in generates]
    try:
        firsts = await _first_events(queues, request, deadline)
    except TimeoutError:
        firsts = [timed_out(ids[0], timeout_s)]
    if firsts is None:  # the client left before anything came back
        for request_id in ids:
            client.abort(request_id)
        return Response(status_code=499)
    for event in firsts:
        failure = failure_response(event, media)
        if failure is not None:
            for request_id in ids:
                client.abort(request_id)
            return failure
    ttft_s = time.perf_counter() - started
    chunks: list[Chunk] = [e for e in firsts if isinstance(e, Chunk)]
    if not generates[0].output.stream:
        for request_id in ids:
            client.done(request_id)
        merge = merge_embedding_bodies if generates[0].output.kind == "embedding" else merge_bodies
        body = chunks[0].data if len(chunks) == 1 else merge(chunks)
        prompt, completion = _usage(chunks)
        times = _slowest([c.times for c in chunks])
        metrics.observe_generation(ttft_s, ttft_s, prompt, completion, streamed=False, times=times)
        headers = {"Server-Timing": times.server_timing(ttft_s)} if times is not None else None
        return Response(body, media_type="application/json", headers=headers)
    relay = _relay(
        client, ids, chunks, queues, generates[0].output, media, started, ttft_s, deadline,
        timeout_s,
    )  # fmt: skip
    return StreamingResponse(
        relay,
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _first_events(
    queues: list[asyncio.Queue[Event]], request: Request, deadline: float
) -> list[Event] | None:
    """Each queue's first event, or None if the client disconnects first; TimeoutError at the
    deadline."""
    gather: asyncio.Future[list[Event]] = asyncio.ensure_future(
        asyncio.gather(*(q.get() for q in queues))
    )
    disconnect: asyncio.Future[None] = asyncio.ensure_future(_disconnected(request))
    waiting: set[asyncio.Future[Any]] = {gather, disconnect}
    done, pending = await asyncio.wait(
        waiting, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
    )
    for task in pending:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # retrieved, so a client that left is not logged as an error
    if not done:
        raise TimeoutError
    return gather.result() if gather in done else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _relay(
    client: ClusterClient,
    ids: list[str],
    firsts: list[Chunk],
    queues: list[asyncio.Queue[Event]],
    output: OutputOptions,
    media: str,
    started: float,
    ttft_s: float,
    deadline: float,
    timeout_s: float,
) -> AsyncIterator[bytes]:
    """SSE bytes until every sub-request is done. A failure, or the deadline, sends a final
    error frame; a client that leaves (the generator is closed) aborts what is still running."""
    open_ids = set(ids)
    endings: list[Chunk] = []
    merged: asyncio.Queue[tuple[str, Event]] = asyncio.Queue()
    pumps = [
        asyncio.create_task(_pump(request_id, first, queue, merged))
        for request_id, first, queue in zip(ids, firsts, queues, strict=True)
    ]
    try:
        while open_ids:
            try:
                request_id, event = await asyncio.wait_for(
                    merged.get(), max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                yield error_frame(timed_out(ids[0], timeout_s), media)
                return
            if failure_response(event) is not None:
                yield error_frame(event, media)
                return
            assert isinstance(event, Chunk)
            if not event.done:
                yield event.data
                continue
            open_ids.discard(request_id)
            endings.append(event)
            client.done(request_id)
            if event.data:  # its last frames (and, unless fanned out, its ending)
                yield event.data
        if len(ids) > 1:
            yield stream_ending(output, endings)
        prompt, completion = _usage(endings)
        e2e_s = time.perf_counter() - started
        times = _slowest([c.times for c in endings])
        metrics.observe_generation(ttft_s, e2e_s, prompt, completion, streamed=True, times=times)
    finally:
        for task in pumps:
            task.cancel()
        for request_id in open_ids:
            client.abort(request_id)


async def _pump(
    request_id: str,
    first: Chunk,
    queue: asyncio.Queue[Event],
    out: asyncio.Queue[tuple[str, Event]],
) -> None:
    event: Event = first
    while True:
        out.put_nowait((request_id, event))
        if isinstance(event, RequestFailed) or event.done:
            return
        event = await queue.get()


def _usage(endings: list[Chunk]) -> tuple[int, int]:
    return sum(c.prompt_tokens for c in endings), sum(c.completion_tokens for c in endings)


def _slowest(times: Iterable[StageTimes | UnsetType | None]) -> StageTimes | None:
    """Several prompts' stage times as one response's: each stage's longest (they run side by
    side); None when there are none."""
    measured = [t for t in times if isinstance(t, StageTimes)]
    return functools.reduce(StageTimes.slowest, measured) if measured else None


def merge_bodies(endings: list[Chunk]) -> bytes:
    """Several prompts' completion bodies as one: choices in order, usage summed."""
    parts = [msgspec.json.decode(c.data, type=Completion) for c in endings]
    merged = parts[0]
    merged.choices = [c for p in parts for c in p.choices]
    merged.usage = summed_usage(endings)
    merged.perf_metrics = _slowest([p.perf_metrics for p in parts]) or UNSET
    return msgspec.json.encode(merged)


def merge_embedding_bodies(endings: list[Chunk]) -> bytes:
    """Several inputs' embedding bodies as one: vectors in order, usage summed."""
    parts = [msgspec.json.decode(c.data, type=EmbeddingList) for c in endings]
    merged = parts[0]
    merged.data = [item for p in parts for item in p.data]
    prompt_tokens = sum(c.prompt_tokens for c in endings)
    merged.usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    return msgspec.json.encode(merged)


def stream_ending(output: OutputOptions, endings: list[Chunk]) -> bytes:
    """A fanned-out stream's one ending, as a single request's postproc worker writes it
    (postproc_worker/openai_frames.end_of_stream): a last chunk with no choices when the client
    asked for the usage (summed) or the perf metrics (each stage's slowest), then [DONE]."""
    if not (output.include_usage or output.perf_metrics):
        return SSE_DONE
    last = Completion(
        id=output.response_id,
        created=output.created,
        model=output.model,
        choices=[],
        usage=summed_usage(endings) if output.include_usage else UNSET,
    )
    if output.perf_metrics:
        last.perf_metrics = _slowest([c.times for c in endings]) or UNSET
    return b"data: " + msgspec.json.encode(last) + b"\n\n" + SSE_DONE


def summed_usage(endings: list[Chunk]) -> Usage:
    """The response's usage from its sub-requests' ending Chunks."""
    prompt, completion = _usage(endings)
    cached = sum(c.cached_tokens for c in endings)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
