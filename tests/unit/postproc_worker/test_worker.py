"""The postproc worker's loop around the formatter, without sockets: what a frontend gets when a
request ends normally, nothing when it failed elsewhere (the frontend answers that request with
the orchestrator's error; a closing chunk could reach it first and turn the error into a
truncated 200), stop strings sent upstream, and when a draining worker may leave."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from common.protocol import (
    FAILED,
    Abort,
    Chunk,
    GenerateRequest,
    OutputOptions,
    TokenBatch,
    TokenDelta,
    encode_token_ids,
    pack_postproc_start,
)
from common.sampling_params import SamplingParams
from common.tokenizer import load_tokenizer
from common.worker_process import ORCHESTRATOR, Outbox
from postproc_worker.worker import DRAIN_QUIET_S, PostprocWorker
from tests.unit.worker_doubles import FRONTEND, Clock

NOW = 1000.0


@pytest.fixture
def worker(tiny_model_path: Path) -> PostprocWorker:
    return PostprocWorker(load_tokenizer(tiny_model_path), Clock(NOW))


def announce(
    worker: PostprocWorker,
    request_id: str,
    stream: bool = False,
    stop: list[str] | None = None,
    **output: Any,
) -> Outbox:
    """The first token of a request, as a generation worker forwards it; `output`: more
    OutputOptions fields. The prompt is 3 tokens, 2 of them cached."""
    request = GenerateRequest(
        request_id=request_id,
        prompt_token_ids_b64=encode_token_ids([5, 6, 7]),
        sampling=SamplingParams(max_tokens=8),
        output=OutputOptions(
            kind="completion", model="tiny", created=0, stream=stream, stop=stop or [], **output
        ),
        reply_to=FRONTEND,
    )
    start = pack_postproc_start(request.postproc_start())
    first = TokenDelta(request_id, 0, [72], num_prompt_tokens=3, num_cached_tokens=2)
    return worker.handle(TokenBatch(starts=[start], deltas=[first]), NOW)


def chunks(out: Outbox) -> list[Chunk]:
    """What went to the frontend."""
    assert all(to == FRONTEND for to, _ in out), out
    assert all(isinstance(message, Chunk) for _, message in out)
    return [message for _, message in out]  # type: ignore[misc]


def test_an_aborted_request_gets_its_closing_chunk(worker) -> None:
    out = announce(worker, "cmpl-abort")
    out += worker.handle(
        TokenBatch(deltas=[TokenDelta("cmpl-abort", 0, [], finish_reason="abort")]), NOW
    )
    received = chunks(out)
    assert received and received[-1].done and received[-1].status_code == 200
    assert worker.requests == {}


def test_a_failed_request_is_dropped_without_a_closing_chunk(worker) -> None:
    out = announce(worker, "cmpl-failed")
    out += worker.handle(
        TokenBatch(deltas=[TokenDelta("cmpl-failed", 0, [], finish_reason=FAILED)]), NOW
    )
    assert not any(c.done for c in chunks(out))
    assert worker.requests == {} and worker.reply_to == {}


def test_token_batches_become_sse_frames_then_the_ending(worker) -> None:
    tokenizer = worker.tokenizer
    out = announce(worker, "cmpl-stream", stream=True)
    ids = tokenizer.encode(" world")
    out += worker.handle(TokenBatch(deltas=[TokenDelta("cmpl-stream", 0, ids)]), NOW)
    out += worker.handle(
        TokenBatch(deltas=[TokenDelta("cmpl-stream", 0, [], finish_reason="length")]), NOW
    )
    received = chunks(out)
    assert all(c.data.startswith(b"data: ") for c in received)
    assert [c.done for c in received] == [False] * (len(received) - 1) + [True]
    assert received[-1].data.endswith(b"data: [DONE]\n\n")
    assert received[-1].completion_tokens == 1 + len(ids)
    events = [e for c in received for e in c.data.split(b"\n\n") if e and e != b"data: [DONE]"]
    texts = [json.loads(e.removeprefix(b"data: "))["choices"] for e in events]
    assert "".join(c[0]["text"] for c in texts if c) == tokenizer.decode([72, *ids])
    assert worker.requests == {}


def test_a_fanned_out_stream_ends_with_numbers_and_no_usage_chunk_or_done(worker) -> None:
    out = announce(
        worker, "cmpl-x-1", stream=True, include_usage=True, perf_metrics=True, fanned_out=True
    )
    out += worker.handle(
        TokenBatch(deltas=[TokenDelta("cmpl-x-1", 0, [73], finish_reason="length")]), NOW
    )
    received = chunks(out)
    assert received[-1].done and b"[DONE]" not in b"".join(c.data for c in received)
    payloads = [e.removeprefix(b"data: ") for c in received for e in c.data.split(b"\n\n") if e]
    assert all(json.loads(p)["choices"] for p in payloads)  # no last chunk without choices
    assert all(json.loads(p)["usage"] is None for p in payloads)  # include_usage's null
    ending = received[-1]
    numbers = (ending.prompt_tokens, ending.cached_tokens, ending.completion_tokens)
    assert numbers == (3, 2, 2) and ending.times is not None


def test_a_single_stream_ends_with_its_usage_chunk_and_done(worker) -> None:
    out = announce(worker, "cmpl-one", stream=True, include_usage=True)
    out += worker.handle(
        TokenBatch(deltas=[TokenDelta("cmpl-one", 0, [73], finish_reason="length")]), NOW
    )
    received = chunks(out)
    last, done = received[-1].data.split(b"\n\n")[-3:-1]
    assert done == b"data: [DONE]"
    usage = json.loads(last.removeprefix(b"data: "))["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                     "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
    assert received[-1].cached_tokens == 2


def test_a_stop_string_ends_the_request_and_aborts_it_upstream(worker) -> None:
    tokenizer = worker.tokenizer
    out = announce(worker, "cmpl-stop", stop=["world"])
    out += worker.handle(
        TokenBatch(deltas=[TokenDelta("cmpl-stop", 0, tokenizer.encode(" world and more"))]), NOW
    )
    upstream = [message for to, message in out if to == ORCHESTRATOR]
    assert upstream == [Abort(request_id="cmpl-stop", reason="stop")]
    (body,) = chunks([pair for pair in out if pair[0] != ORCHESTRATOR])
    assert body.done and b"world" not in body.data
    later = TokenBatch(deltas=[TokenDelta("cmpl-stop", 0, [72], finish_reason="abort")])
    assert worker.handle(later, NOW) == []  # the abort's ending finds it gone


def test_an_abort_from_the_orchestrator_drops_the_request_silently(worker) -> None:
    announce(worker, "cmpl-gone")
    assert worker.handle(Abort(request_id="cmpl-gone", reason="error"), NOW) == []
    assert worker.requests == {}


def test_a_draining_worker_waits_for_a_quiet_spell(worker) -> None:
    assert not worker.idle(NOW + DRAIN_QUIET_S)
    assert worker.idle(NOW + DRAIN_QUIET_S + 0.01)  # no batch since it started
    announce(worker, "cmpl-drain")
    assert not worker.idle(NOW + 10 * DRAIN_QUIET_S)  # a stream is open
    worker.handle(
        TokenBatch(deltas=[TokenDelta("cmpl-drain", 0, [], finish_reason="abort")]), NOW + 5
    )
    assert not worker.idle(NOW + 5 + DRAIN_QUIET_S)  # a last batch may still be on its way
    assert worker.idle(NOW + 5 + DRAIN_QUIET_S + 0.01)


def test_a_malformed_start_costs_only_its_own_request(worker: PostprocWorker) -> None:
    bad = msgspec.Raw(msgspec.msgpack.encode({"request_id": "cmpl-bad"}))  # no reply_to, output
    batch = TokenBatch(starts=[bad], deltas=[TokenDelta("cmpl-bad", 0, [72])])
    assert worker.handle(batch, NOW) == [] and not worker.requests
    announce(worker, "cmpl-good")  # the next request is taken in as ever
    assert list(worker.requests) == ["cmpl-good"]
