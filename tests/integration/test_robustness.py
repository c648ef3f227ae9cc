"""Disconnects, garbage on the internal sockets, and load: the cluster keeps serving, leaks no KV
block, keeps no stuck request, and sheds load with 429 + Retry-After instead of queueing without
end."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest
import zmq

from common.protocol import (
    PROTOCOL_VERSION,
    ClusterInfoRequest,
    Refused,
    Register,
    decode,
    encode,
)
from tests.integration.harness import MODEL, Cluster

MAX_REQUESTS = 64  # the orchestrator's limit in this cluster: more in flight get a 429


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    orchestrator = f"router: kv_aware, worker_timeout_seconds: 5, max_requests: {MAX_REQUESTS}"
    return start_cluster("disaggregated", orchestrator=orchestrator)


def assert_clean(cluster: Cluster) -> None:
    info = cluster.wait_idle(timeout_s=30)
    assert info.num_requests == 0, "requests stuck in the orchestrator"
    for worker in info.workers:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker
        assert worker.active_requests == 0, worker


async def one_request(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """A request that the client may abandon at a random point; returns what happened."""
    stream = rng.random() < 0.5
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: " + "tell me about rivers " * rng.randint(1, 30),
        "max_tokens": rng.randint(4, 24),
        "temperature": 0.8,
        "stream": stream,
    }
    leave_after_s = rng.uniform(0.0, 0.4) if rng.random() < 1 / 3 else None
    while True:
        try:
            return await asyncio.wait_for(_send(client, body, stream), leave_after_s)
        except TimeoutError:
            return "left"
        except _Busy as busy:
            await asyncio.sleep(busy.retry_after_s)


class _Busy(Exception):
    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s


async def _send(client: httpx.AsyncClient, body: dict, stream: bool) -> str:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code in (429, 503):
            raise _Busy(float(response.headers["retry-after"]))
        assert response.status_code == 200, await response.aread()
        data = b"".join([chunk async for chunk in response.aiter_bytes()])
    if stream:
        assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
    else:
        assert msgspec.json.decode(data)["choices"]
    return "done"


async def many(cluster: Cluster, count: int, concurrency: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60, limits=limits) as client:

        async def gated(i: int) -> str:
            async with gate:
                return await one_request(client, rng, i)

        return await asyncio.gather(*(gated(i) for i in range(count)))


def test_random_disconnects_leak_nothing(cluster: Cluster) -> None:
    outcomes = asyncio.run(many(cluster, count=150, concurrency=24, seed=1))
    assert outcomes.count("left") > 20 and outcomes.count("done") > 60
    assert_clean(cluster)


@pytest.mark.long
def test_a_thousand_requests_with_random_disconnects_leak_nothing(cluster: Cluster) -> None:
    start = time.monotonic()
    outcomes = asyncio.run(many(cluster, count=1000, concurrency=32, seed=2))
    assert time.monotonic() - start < 600
    assert outcomes.count("left") > 200
    assert_clean(cluster)


def test_256_streaming_clients_all_finish_and_the_excess_is_told_to_retry(cluster: Cluster) -> None:
    statuses: list[int] = []

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120, limits=limits) as client:

            async def client_loop(i: int) -> str:
                body = {
                    "model": MODEL,
                    "prompt": f"Client {i} says",
                    "max_tokens": 8,
                    "stream": True,
                }
                while True:
                    try:
                        return await _send(client, body, stream=True)
                    except _Busy as busy:
                        statuses.append(429)
                        await asyncio.sleep(busy.retry_after_s)

            return await asyncio.gather(*(client_loop(i) for i in range(256)))

    outcomes = asyncio.run(run())
    assert outcomes == ["done"] * 256
    assert statuses, "256 at once over a limit of 64 must see 429s"
    assert_clean(cluster)


def test_an_idle_connection_outlives_the_clients_keep_alive_expiry(cluster: Cluster) -> None:
    """httpx (so the openai SDK) reuses a pooled connection for up to 5 s: a server that closes
    it sooner races the client's next request, which then fails with no response (a ReadError
    seen under load). The server keeps it longer, so the client is always the one to close."""
    host, port = urlsplit(cluster.url).hostname, urlsplit(cluster.url).port
    request = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(request)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(httpx.Limits().keepalive_expiry + 1)
        sock.sendall(request)
        assert _read_response(sock).startswith(b"HTTP/1.1 200"), "closed while idle"


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body (b"" if the server closed instead)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def internal_addresses(cluster: Cluster) -> tuple[str, str]:
    """(the orchestrator's address, a postproc worker's)."""
    config = (cluster.log_path.parent / "cluster.yaml").read_text()
    orchestrator = config.split('address: "')[1].split('"')[0]
    postproc = next(w.address for w in cluster.info().workers if w.role == "postproc")
    return orchestrator, postproc


def test_a_stranger_on_the_internal_sockets_gets_nothing_through(cluster: Cluster) -> None:
    """The integrity issue's fourth case: any local process could ask the orchestrator for
    completions (bypassing api_key), register as a worker and read prompts, or push chunks
    into other users' streams. Without the cluster's CURVE keys nothing gets through: no
    answer, no registration, no effect on the streams."""
    orchestrator, postproc = internal_addresses(cluster)
    log_start = len(cluster.log_tail(None))
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IDENTITY, b"gen-0")  # would have taken over gen-0's identity
        dealer.connect(orchestrator)
        dealer.send(encode(ClusterInfoRequest()))
        intruder = Register(
            worker_id="intruder",
            role="postproc",
            protocol_version=PROTOCOL_VERSION,
            pid=1,
            address="tcp://127.0.0.1:9",
        )
        dealer.send(encode(intruder))  # fmt: skip
        assert not dealer.poll(2000)  # the handshake never completes: nothing is read
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(postproc)
        push.send(b"\x00\x01 a forged chunk", zmq.NOBLOCK)
        dealer.close()
        push.close()
    finally:
        context.term()
    workers = {w.worker_id for w in cluster.info().workers}
    assert "intruder" not in workers and all(w.state == "ready" for w in cluster.info().workers)
    assert "dropped a malformed message" not in cluster.log_tail(None)[log_start:]
    result = httpx.post(f"{cluster.base_url}/completions",
                        json={"model": MODEL, "prompt": "Still mine?"}, timeout=30)  # fmt: skip
    assert result.status_code == 200


def test_garbage_on_internal_sockets_is_dropped_and_the_cluster_serves(cluster: Cluster) -> None:
    """From inside (a process with the keys, a buggy peer): malformed frames are dropped."""
    orchestrator, postproc = internal_addresses(cluster)
    context = cluster.insider_context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(orchestrator)
        for frame in (b"\xc1garbage", msgspec.msgpack.encode({"type": "nope"}), b""):
            dealer.send(frame)
        old = Register(
            worker_id="intruder", role="generation", protocol_version=PROTOCOL_VERSION + 1, pid=1
        )
        dealer.send(encode(old))
        assert dealer.poll(5000)
        refused = decode(dealer.recv())
        assert isinstance(refused, Refused) and str(PROTOCOL_VERSION + 1) in refused.reason
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(postproc)
        push.send(b"\x00\x01 not a token batch")
        time.sleep(0.5)
        dealer.close()
        push.close()
    finally:
        context.term()
    log = cluster.log_tail(200_000)
    assert "dropped a malformed message" in log
    assert all(w.state == "ready" for w in cluster.info().workers)
    result = httpx.post(
        f"{cluster.base_url}/completions",
        json={"model": MODEL, "prompt": "Still fine?"},
        timeout=30,
    )
    assert result.status_code == 200
    assert "intruder" not in {w.worker_id for w in cluster.info().workers}
