"""A worker's connection to the orchestrator: register, heartbeat, receive commands.

Shared by every worker kind (context, generation, postproc) so that registration behaves the same
everywhere: a refused registration (protocol version, duplicate id) ends the process with exit
code 2, which the supervisor does not restart; an orchestrator that restarted and no longer knows
the worker, or declared it dead, answers a heartbeat with RegisterAgain, and the worker registers
again.

Drain (SIGTERM, `orchestrator drain`, scaling down) is the link's too, the same for every worker:
the worker asks with `drain()`, the orchestrator answers Drain(in_flight) once it routes nothing
new to the worker, and `drained()` says when the worker may leave: that answer came, nothing in
the orchestrator's table passes through it, and the worker's own `idle()` holds.

Liveness is apart from progress: heartbeats go out from a thread of their own, on a socket of
their own, every `heartbeat_interval_seconds` whatever the loop is doing (torch releases the GIL
in its kernels), so a long engine step no longer looks like a dead worker. Each heartbeat says
how long ago the loop last finished a step (`progress_age_s`): the orchestrator reports a worker
alive but not progressing as stalled and routes around it. Only a process that is stopped, gone
or wedged with the GIL held misses its heartbeats.

    main thread:  register ─ step ─ link.progress() ─ step ─ ...   (commands on the DEALER)
    heartbeats:   ─ Heartbeat(stats snapshot, progress age, peers version) every interval ─▶
                  (its own DEALER; a RegisterAgain answer is passed to the main thread)
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

import zmq

from common.config import OrchestratorConfig
from common.protocol import (
    Drain,
    Heartbeat,
    Leaving,
    Message,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    WorkerStats,
    encode,
)
from common.transport import make_socket, recv, send

logger = logging.getLogger(__name__)

EXIT_REFUSED = 2
EXIT_ENGINE_FAULT = 3  # an engine step raised: the supervisor restarts the worker
STATS_WAIT_S = 0.05  # how long a heartbeat waits for the loop to read fresh stats
LEAVE_LINGER_MS = 2000  # a drained worker's last messages get this long to go out


class OrchestratorLink:
    """A DEALER whose identity is the worker id, so the orchestrator can address it by name."""

    def __init__(
        self,
        context: zmq.Context,
        orchestrator: OrchestratorConfig,
        register: Register,
        stats: Callable[[], WorkerStats],
    ) -> None:
        self.register_message = register
        self.heartbeat_interval_s = orchestrator.heartbeat_interval_seconds
        self.stats = stats
        self.context = context
        self.address = orchestrator.address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, register.worker_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(orchestrator.address)
        self.registered: Registered | None = None
        self.peers_version = 0  # of the last Registered applied (the orchestrator resends newer)
        self._registered_at = 0.0
        # Shared with the heartbeat thread: plain attribute reads and writes, each atomic.
        self._stats_snapshot: WorkerStats = stats()
        self._progress_at = time.monotonic()
        self._stats_wanted = threading.Event()  # the thread asks the loop for fresh stats ...
        self._stats_taken = threading.Event()  # ... and the loop says it took them
        self._register_again = threading.Event()
        self._stop_heartbeats = threading.Event()
        self._heartbeats: threading.Thread | None = None
        self.draining = False
        self.drain_in_flight: int | None = None  # the orchestrator's count; None: not answered
        self._unread: list[Message] = []  # read by register() after its answer, for the loop

    @property
    def worker_id(self) -> str:
        return self.register_message.worker_id

    def register(self, stop: threading.Event, timeout_s: float = 120.0) -> Registered | None:
        """Send Register until the orchestrator answers (it may start after the worker), then
        start the heartbeats; None when `stop` is set first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop.is_set():
            send(self.socket, self.register_message)
            if self.socket.poll(1000):
                messages = self.receive()
                for i, message in enumerate(messages):
                    if isinstance(message, Registered):
                        # The orchestrator routes work here from this moment: commands read
                        # with the answer are the loop's first (a DecodeRequest was lost so).
                        self._unread = messages[i + 1 :]
                        self.start_heartbeats()
                        return message
        if stop.is_set():
            return None
        logger.error("%s: no answer from the orchestrator in %.0f s", self.worker_id, timeout_s)
        sys.exit(1)

    def receive(self) -> list[Message]:
        """Everything waiting, minus the link's own traffic (Refused exits, RegisterAgain
        re-registers); Registered updates are both kept here and returned."""
        messages, self._unread = self._unread, []
        if self._register_again.is_set():
            self._register_again.clear()
            self._send_register_again()
        while (message := recv(self.socket, "the orchestrator")) is not None:
            if isinstance(message, Refused):
                logger.error("%s: registration refused: %s", self.worker_id, message.reason)
                sys.exit(EXIT_REFUSED)
            if isinstance(message, RegisterAgain):
                self._send_register_again()
                continue
            if isinstance(message, Drain):
                if not self.draining:
                    logger.info("%s: draining (asked by the orchestrator)", self.worker_id)
                self.draining = True
                self.drain_in_flight = message.in_flight
                continue
            if isinstance(message, Registered):
                self.registered = message
                self.peers_version = message.peers_version
            messages.append(message)
        return messages

    def _send_register_again(self) -> None:
        # Every heartbeat sent while the orchestrator was down is answered: once will do.
        if time.monotonic() - self._registered_at > self.heartbeat_interval_s:
            logger.warning(
                "%s: the orchestrator lost us (it restarted, or declared us dead); registering "
                "again",
                self.worker_id,
            )
            send(self.socket, self.register_message)
            self._registered_at = time.monotonic()
            if self.draining:  # the new record is ready: mark it draining again
                self.drain_in_flight = None
                send(self.socket, Drain(worker_id=self.worker_id))

    def drain(self) -> None:
        """Ask the orchestrator to route nothing new here; see `drained`."""
        if not self.draining:
            logger.info("%s: draining: finishing what it holds, then leaving", self.worker_id)
            self.draining = True
            send(self.socket, Drain(worker_id=self.worker_id))

    def drained(self, idle: bool) -> bool:
        """Draining, nothing more can arrive, and nothing is left (`idle`: the worker's own)."""
        return self.draining and self.drain_in_flight == 0 and idle

    def leave(self) -> None:
        """The last message of a drained worker; it then closes (its messages go out first)."""
        send(self.socket, Leaving(worker_id=self.worker_id))
        self.close(linger_ms=LEAVE_LINGER_MS)

    def send(self, message: Message) -> None:
        send(self.socket, message)

    def progress(self) -> None:
        """The loop finished a step. Stats are read here, in the loop that owns the engine, when
        the heartbeat thread asks for them: once per heartbeat."""
        self._progress_at = time.monotonic()
        if self._stats_wanted.is_set():
            self._stats_wanted.clear()
            self._stats_snapshot = self.stats()
            self._stats_taken.set()

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            stats=self._stats_snapshot,
            progress_age_s=round(time.monotonic() - self._progress_at, 3),
            peers_version=self.peers_version,
        )

    def start_heartbeats(self) -> None:
        if self._heartbeats is None:
            self._heartbeats = threading.Thread(
                target=self._send_heartbeats, name=f"{self.worker_id}-heartbeats", daemon=True
            )
            self._heartbeats.start()

    def _send_heartbeats(self) -> None:
        """The heartbeat thread: its own socket (zmq sockets are not shared across threads)."""
        sock = make_socket(self.context, zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}/heartbeats".encode())
        sock.connect(self.address)
        try:
            while not self._stop_heartbeats.is_set():
                # Fresh stats from the loop if it finishes a step soon; a loop in a long step
                # gets its old stats sent, with the age of its progress.
                self._stats_taken.clear()
                self._stats_wanted.set()
                self._stats_taken.wait(STATS_WAIT_S)
                send(sock, self.heartbeat())
                while (message := recv(sock, "the orchestrator")) is not None:
                    if isinstance(message, RegisterAgain):
                        self._register_again.set()  # the main thread owns registration
                self._stop_heartbeats.wait(self.heartbeat_interval_s)
        finally:
            sock.close()

    def close(self, linger_ms: int = 0) -> None:
        """Stop the heartbeats (the orchestrator then marks the worker dead) and the socket,
        which delivers what it still queues for up to `linger_ms`."""
        self._stop_heartbeats.set()
        if self._heartbeats is not None:
            self._heartbeats.join(timeout=5)
        self.socket.close(linger=linger_ms)


class PushSockets:
    """One PUSH socket per peer address (postproc workers, frontends), connected on first use."""

    def __init__(self, context: zmq.Context) -> None:
        self.context = context
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, address: str, message: Message) -> None:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._sockets[address] = make_socket(self.context, zmq.PUSH, connect=address)
        try:
            sock.send(encode(message), zmq.NOBLOCK)  # a stuck peer must not stall the loop
        except zmq.Again:
            logger.warning("dropped a %s to %s: its queue is full", type(message).__name__, address)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
