"""A worker's connection to the orchestrator: register, heartbeat, receive commands.

Shared by every worker kind (context, generation, postproc) so that registration behaves the same
everywhere: a refused registration (protocol version, duplicate id) ends the process with exit
code 2, which the supervisor does not restart; an orchestrator that restarted and no longer knows
the worker answers a heartbeat with RegisterAgain, and the worker registers again.
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
    Heartbeat,
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
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, register.worker_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(orchestrator.address)
        self.registered: Registered | None = None
        self._next_heartbeat = 0.0
        self._registered_at = 0.0

    @property
    def worker_id(self) -> str:
        return self.register_message.worker_id

    def register(self, stop: threading.Event, timeout_s: float = 120.0) -> Registered | None:
        """Send Register until the orchestrator answers (it may start after the worker); None
        when `stop` is set first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not stop.is_set():
            send(self.socket, self.register_message)
            if self.socket.poll(1000):
                for message in self.receive():
                    if isinstance(message, Registered):
                        self.registered = message
                        return message
        if stop.is_set():
            return None
        logger.error("%s: no answer from the orchestrator in %.0f s", self.worker_id, timeout_s)
        sys.exit(1)

    def receive(self) -> list[Message]:
        """Everything waiting, minus the link's own traffic (Refused exits, RegisterAgain
        re-registers); Registered updates are both kept here and returned."""
        messages: list[Message] = []
        while (message := recv(self.socket, "the orchestrator")) is not None:
            if isinstance(message, Refused):
                logger.error("%s: registration refused: %s", self.worker_id, message.reason)
                sys.exit(EXIT_REFUSED)
            if isinstance(message, RegisterAgain):
                # Every heartbeat sent while the orchestrator was down is answered: once will do.
                if time.monotonic() - self._registered_at > self.heartbeat_interval_s:
                    logger.warning(
                        "%s: the orchestrator restarted; registering again", self.worker_id
                    )
                    send(self.socket, self.register_message)
                    self._registered_at = time.monotonic()
                continue
            if isinstance(message, Registered):
                self.registered = message
            messages.append(message)
        return messages

    def send(self, message: Message) -> None:
        send(self.socket, message)

    def heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval_s
            send(self.socket, Heartbeat(worker_id=self.worker_id, stats=self.stats()))


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
