"""The executor-fault boundary: an engine step that raises fails every request the worker holds
at once (a 500 each, sent before it goes) and ends the process with EXIT_ENGINE_FAULT for the
supervisor to restart, instead of carrying on with engine state no one can trust. A real
generation worker on loopback, a ROUTER standing for the orchestrator."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from common.config import parse_cluster_config
from common.protocol import (
    DecodeRequest,
    GenerateRequest,
    OutputOptions,
    Register,
    Registered,
    RequestFailed,
    decode,
    encode_token_ids,
    pack_postproc_start,
)
from common.sampling_params import SamplingParams
from common.transport import bind_random_port, make_socket, send_to
from common.worker_link import EXIT_ENGINE_FAULT
from common.worker_process import WorkerProcess
from generation_worker.main import make_process

WAIT_MS = 5000


@pytest.fixture
def orchestrator_and_worker(
    tiny_model_path: Path,
) -> Iterator[tuple[zmq.Socket, WorkerProcess]]:
    context = zmq.Context()
    router = make_socket(context, zmq.ROUTER)
    address = bind_random_port(router, "127.0.0.1")
    config = parse_cluster_config(
        f"model: {tiny_model_path}\norchestrator: {{address: {address}}}\n"
        "kv_cache: {num_blocks: 64}\n"
    )
    worker = make_process(config, "gen-0", context)
    try:
        yield router, worker
    finally:
        worker.close()
        router.close()
        context.term()


def register(router: zmq.Socket, worker: WorkerProcess) -> None:
    def answer() -> None:
        assert router.poll(WAIT_MS)
        identity, frame = router.recv_multipart()
        assert isinstance(decode(frame), Register)
        send_to(router, identity, Registered())

    thread = threading.Thread(target=answer)
    thread.start()
    worker.on_registered(worker.link.register(threading.Event(), timeout_s=10))
    thread.join(10)


def decode_request(request_id: str) -> DecodeRequest:
    request = GenerateRequest(
        request_id=request_id,
        prompt_token_ids_b64=encode_token_ids([5, 6, 7, 8]),
        sampling=SamplingParams(max_tokens=50, temperature=0.0),
        output=OutputOptions(),
        reply_to="tcp://127.0.0.1:9",
    )
    return DecodeRequest(
        request=request.engine_request(),
        postproc_address="tcp://127.0.0.1:9",
        postproc_start=pack_postproc_start(request.postproc_start()),
    )


def test_a_failed_engine_step_fails_every_request_then_exits(orchestrator_and_worker) -> None:
    router, worker = orchestrator_and_worker
    register(router, worker)
    for request_id in ("r1", "r2"):
        send_to(router, b"gen-0", decode_request(request_id))
    while len(worker.core.active) < 2:
        worker.step()

    def broken_step() -> list:
        raise RuntimeError("a kernel fault")

    worker.core.engine.step = broken_step  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exited:
        worker.step()
    assert exited.value.code == EXIT_ENGINE_FAULT
    failures = {}
    while router.poll(WAIT_MS):
        identity, frame = router.recv_multipart()
        message = decode(frame)
        if isinstance(message, RequestFailed):
            failures[message.request_id] = message
            if len(failures) == 2:
                break
    assert set(failures) == {"r1", "r2"}
    assert all(f.status_code == 500 and "restarting" in f.message for f in failures.values())
