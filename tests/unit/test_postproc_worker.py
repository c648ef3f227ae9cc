"""The postproc worker's loop around the formatter, on real loopback sockets: what a frontend gets
when a request ends normally, and nothing when it failed elsewhere (the frontend answers that
request with the orchestrator's error; a closing chunk could reach it first and turn the error
into a truncated 200)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from common.config import parse_cluster_config
from common.protocol import (
    FAILED,
    Chunk,
    GenerateRequest,
    OutputOptions,
    TokenBatch,
    TokenDelta,
    encode_token_ids,
)
from common.sampling_params import SamplingParams
from common.transport import parse
from postproc_worker.worker import PostprocWorker
from tests.integration.harness import free_port

WAIT_MS = 1000  # loopback delivers at once; this long with nothing means nothing comes


@pytest.fixture
def frontend_and_worker(tiny_model_path: Path) -> Iterator[tuple[zmq.Socket, str, PostprocWorker]]:
    """A PULL socket standing for the frontend, and a worker (its orchestrator never answers)."""
    context = zmq.Context()
    frontend = context.socket(zmq.PULL)
    port = frontend.bind_to_random_port("tcp://127.0.0.1")
    config = parse_cluster_config(
        f"model: {tiny_model_path}\norchestrator: {{address: tcp://127.0.0.1:{free_port()}}}\n"
    )
    worker = PostprocWorker(config, "pp-test", context)
    try:
        yield frontend, f"tcp://127.0.0.1:{port}", worker
    finally:
        worker.close()
        frontend.close(linger=0)
        context.term()


def announce(worker: PostprocWorker, request_id: str, reply_to: str) -> None:
    """The first token of a request, as a generation worker forwards it."""
    request = GenerateRequest(
        request_id=request_id,
        prompt_token_ids_b64=encode_token_ids([5, 6, 7]),
        sampling=SamplingParams(max_tokens=8),
        output=OutputOptions(kind="completion", model="tiny", created=0, stream=False),
        reply_to=reply_to,
    )
    worker.process(TokenBatch(first=[request], deltas=[TokenDelta(request_id, 0, [72])]))


def chunks(frontend: zmq.Socket) -> list[Chunk]:
    """Every chunk that arrives until WAIT_MS pass without one."""
    received = []
    while frontend.poll(WAIT_MS):
        message = parse(frontend.recv(), "test")
        assert isinstance(message, Chunk)
        received.append(message)
    return received


def test_an_aborted_request_gets_its_closing_chunk(frontend_and_worker) -> None:
    frontend, reply_to, worker = frontend_and_worker
    announce(worker, "cmpl-abort", reply_to)
    worker.process(TokenBatch(deltas=[TokenDelta("cmpl-abort", 0, [], finish_reason="abort")]))
    received = chunks(frontend)
    assert received and received[-1].done and received[-1].status_code == 200
    assert worker.requests == {}


def test_a_failed_request_is_dropped_without_a_closing_chunk(frontend_and_worker) -> None:
    frontend, reply_to, worker = frontend_and_worker
    announce(worker, "cmpl-failed", reply_to)
    worker.process(TokenBatch(deltas=[TokenDelta("cmpl-failed", 0, [], finish_reason=FAILED)]))
    assert not any(c.done for c in chunks(frontend))
    assert worker.requests == {} and worker.reply_to == {}
