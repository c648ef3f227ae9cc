"""A worker's link to the orchestrator over real loopback sockets: registration, refusal,
re-registration after an orchestrator restart, and malformed frames dropped with a log line."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from common.config import OrchestratorConfig
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Drain,
    Heartbeat,
    Leaving,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    WorkerStats,
    decode,
    encode,
)
from common.transport import bind_random_port, make_socket, recv, send, send_to
from common.worker_link import EXIT_REFUSED, OrchestratorLink

TIMEOUT_MS = 5000


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket, str]]:
    context = zmq.Context()
    sock = make_socket(context, zmq.ROUTER)
    address = bind_random_port(sock, "127.0.0.1")
    yield sock, address
    sock.close()
    context.term()


def make_link(address: str) -> OrchestratorLink:
    register = Register(
        worker_id="gen-0", role="generation", protocol_version=PROTOCOL_VERSION, pid=1
    )
    orchestrator = OrchestratorConfig(address=address, heartbeat_interval_seconds=0.01)
    return OrchestratorLink(zmq.Context.instance(), orchestrator, register, WorkerStats)


def answer_registration(router: zmq.Socket, reply: object) -> threading.Thread:
    def serve() -> None:
        assert router.poll(TIMEOUT_MS)
        identity, frame = router.recv_multipart()
        assert identity == b"gen-0" and isinstance(decode(frame), Register)
        send_to(router, identity, reply)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_registration_returns_the_orchestrators_answer(router) -> None:
    sock, address = router
    thread = answer_registration(sock, Registered(peers_version=7))
    link = make_link(address)
    registered = link.register(threading.Event(), timeout_s=10)
    thread.join(10)
    assert registered == Registered(peers_version=7) and link.peers_version == 7
    link.close()


def test_a_command_sent_with_the_registration_answer_is_kept_for_the_loop(router) -> None:
    """The orchestrator may route work to a worker the moment it registers: a command that
    arrives in the same read as Registered reaches the loop's first receive(), not the floor."""
    sock, address = router
    work = Drain(worker_id="gen-0", in_flight=0)  # stands for any command
    abort = Abort(request_id="r1")

    def serve() -> None:
        assert sock.poll(TIMEOUT_MS)
        identity, _ = sock.recv_multipart()
        send_to(sock, identity, Registered(peers_version=1))
        send_to(sock, identity, abort)
        send_to(sock, identity, work)

    thread = threading.Thread(target=serve)
    thread.start()
    link = make_link(address)
    send(link.socket, link.register_message)  # answered before register() reads: all three
    thread.join(10)  # wait in the socket together
    time.sleep(0.2)
    assert link.register(threading.Event(), timeout_s=10) == Registered(peers_version=1)
    assert link.receive() == [abort] and link.drain_in_flight == 0
    link.close()


def test_refused_registration_exits_with_the_no_restart_code(router, caplog) -> None:
    sock, address = router
    thread = answer_registration(sock, Refused(reason="protocol version 9, orchestrator 1"))
    link = make_link(address)
    with pytest.raises(SystemExit) as exited, caplog.at_level(logging.ERROR):
        link.register(threading.Event(), timeout_s=10)
    thread.join(10)
    assert exited.value.code == EXIT_REFUSED
    assert "protocol version 9" in caplog.text
    link.socket.close()


def registered_link(sock: zmq.Socket, address: str) -> OrchestratorLink:
    thread = answer_registration(sock, Registered(peers_version=3))
    link = make_link(address)
    assert link.register(threading.Event(), timeout_s=10) == Registered(peers_version=3)
    thread.join(10)
    return link


def next_heartbeat(sock: zmq.Socket) -> tuple[bytes, Heartbeat]:
    while True:
        assert sock.poll(TIMEOUT_MS)
        identity, frame = sock.recv_multipart()
        message = decode(frame)
        if isinstance(message, Heartbeat):
            return identity, message


def test_heartbeats_go_on_while_the_loop_is_busy(router) -> None:
    """A long engine step is not death: the heartbeat thread keeps sending, and says how long
    ago the loop last finished a step."""
    sock, address = router
    link = registered_link(sock, address)
    link.progress()
    time.sleep(0.5)  # the main thread is "in a step": no progress() call
    identity, heartbeat = next_heartbeat(sock)
    while heartbeat.progress_age_s < 0.4:
        identity, heartbeat = next_heartbeat(sock)
    assert identity == b"gen-0/heartbeats" and heartbeat.worker_id == "gen-0"
    assert heartbeat.peers_version == 3
    link.progress()
    while heartbeat.progress_age_s >= 0.4:
        _, heartbeat = next_heartbeat(sock)
    link.close()
    sock.setsockopt(zmq.RCVTIMEO, 300)
    while sock.poll(300):  # drain what was in flight; then nothing more comes
        sock.recv_multipart()
    assert not sock.poll(300)


def test_register_again_resends_the_registration(router) -> None:
    sock, address = router
    link = registered_link(sock, address)
    identity, _ = next_heartbeat(sock)
    send_to(sock, identity, RegisterAgain())  # answered to the heartbeat thread's socket
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while True:  # the main loop's receive() registers again once the thread has passed it on
        assert time.monotonic() < deadline
        assert link.receive() == []
        if sock.poll(50):
            identity, frame = sock.recv_multipart()
            if isinstance(decode(frame), Register):
                break
    assert identity == b"gen-0"  # from the main socket
    link.close()


def next_command(sock: zmq.Socket) -> object:
    """The next message from the link's main socket (heartbeats skipped)."""
    while True:
        assert sock.poll(TIMEOUT_MS)
        identity, frame = sock.recv_multipart()
        if identity == b"gen-0":
            return decode(frame)


def test_a_drained_link_leaves_only_once_the_orchestrator_counts_nothing_in_flight(
    router,
) -> None:
    sock, address = router
    link = registered_link(sock, address)
    link.drain()
    assert next_command(sock) == Drain(worker_id="gen-0")
    assert not link.drained(idle=True)  # not answered: work may still be on its way
    send_to(sock, b"gen-0", Drain(worker_id="gen-0", in_flight=2))
    assert wait_received(link) and link.drain_in_flight == 2
    assert not link.drained(idle=True)
    send_to(sock, b"gen-0", Drain(worker_id="gen-0", in_flight=0))
    assert wait_received(link) and link.drain_in_flight == 0
    assert not link.drained(idle=False) and link.drained(idle=True)
    link.leave()
    assert next_command(sock) == Leaving(worker_id="gen-0")


def wait_received(link: OrchestratorLink) -> bool:
    """Until a Drain the link consumes (it returns nothing) has been read."""
    before = link.drain_in_flight
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        assert link.receive() == []
        if link.drain_in_flight != before:
            return True
        time.sleep(0.01)
    return False


def test_malformed_frames_are_dropped_with_a_log_line(router, caplog) -> None:
    sock, address = router
    dealer = make_socket(zmq.Context.instance(), zmq.DEALER, connect=address)
    dealer.send(b"\xc1 not msgpack")
    dealer.send(encode(Heartbeat(worker_id="ok")))
    with caplog.at_level(logging.WARNING):
        assert sock.poll(TIMEOUT_MS)
        assert recv(sock, "a test peer") is None
        assert sock.poll(TIMEOUT_MS)
        assert recv(sock, "a test peer") == Heartbeat(worker_id="ok")
    assert "dropped a malformed message from a test peer" in caplog.text
    dealer.close()
