"""A worker process's edge: the sockets around a socket-free worker core.

Each worker kind (context, generation, postproc) is a core that takes messages and returns what
to send, as the orchestrator's core does: `handle(message, now)` and `step(now)` return an
`Outbox` of (destination, message) pairs, the destination being `ORCHESTRATOR` or a PUSH
address (a postproc worker, a frontend). `WorkerProcess` owns the sockets and drives the core:

    poll (core.wait_ms()) ─▶ now ─▶ core.handle(each message, now) ─▶ core.step(now) ─▶ send
                                    (orchestrator DEALER, then the PULL socket, if any)

so the core's logic (pulls, leases, drains, abort races) is unit-tested without sockets, with
time passed in.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Protocol

import zmq

from common.config import ClusterConfig
from common.kv_events import KVEventPublisher
from common.protocol import KVEvents, Message, Register, Registered, WorkerStats
from common.transport import recv
from common.worker_link import EXIT_ENGINE_FAULT, OrchestratorLink, PushSockets

logger = logging.getLogger(__name__)

ORCHESTRATOR = "orchestrator"  # the destination of messages for the orchestrator (the DEALER)
Outbox = list[tuple[str, Message]]  # (ORCHESTRATOR or a PUSH address, message), in send order
FAULT_LINGER_MS = 2000  # an exiting worker's last messages get this long to go out


class EngineFault(Exception):
    """An engine step raised: the worker's state is not to be trusted. `out` holds what must
    reach the orchestrator before the process exits (the failures of what it held)."""

    def __init__(self, out: Outbox) -> None:
        super().__init__("an engine step failed")
        self.out = out


class WorkerCore(Protocol):
    def stats(self) -> WorkerStats: ...

    def handle(self, message: Message, now: float) -> Outbox: ...

    def step(self, now: float) -> Outbox: ...

    def wait_ms(self) -> int:
        """How long the loop may wait for a message before the next step (0: step at once)."""
        ...

    def idle(self, now: float) -> bool: ...

    def close(self) -> None: ...


class WorkerProcess:
    """A core with its sockets: the orchestrator link (commands, heartbeats), PUSH sockets to
    peers, the core's own PULL socket (`inputs`, postproc) and KV-event PUB socket (`events`)."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        config: ClusterConfig,
        core: WorkerCore,
        register: Register,
        inputs: zmq.Socket[bytes] | None = None,
        events: KVEventPublisher | None = None,
    ) -> None:
        self.core = core
        self.link = OrchestratorLink(context, config.orchestrator, register, core.stats)
        self.push = PushSockets(context)
        self.inputs = inputs
        self.events = events
        self.poller = zmq.Poller()
        self.poller.register(self.link.socket, zmq.POLLIN)
        if inputs is not None:
            self.poller.register(inputs, zmq.POLLIN)

    def on_registered(self, registered: Registered) -> None:
        self.send(self.core.handle(registered, time.monotonic()))

    def step(self) -> None:
        wait_ms = self.core.wait_ms()
        if wait_ms:
            self.poller.poll(wait_ms)
        now = time.monotonic()
        try:
            for message in self.link.receive():
                self.send(self.core.handle(message, now))
            if self.inputs is not None:
                while (pulled := recv(self.inputs, "a worker")) is not None:
                    self.send(self.core.handle(pulled, now))
            self.send(self.core.step(now))
        except EngineFault as fault:
            self.send(fault.out)
            self.link.close(linger_ms=FAULT_LINGER_MS)  # the failures must leave first
            sys.exit(EXIT_ENGINE_FAULT)
        if self.events is not None:
            self.events.serve_replay()
        self.link.progress()

    def send(self, out: Outbox) -> None:
        for destination, message in out:
            if destination != ORCHESTRATOR:
                self.push.send(destination, message)
                continue
            self.link.send(message)
            if isinstance(message, KVEvents) and self.events is not None:
                self.events.publish(message.events)

    def idle(self) -> bool:
        return self.core.idle(time.monotonic())

    def close(self) -> None:
        self.core.close()
        if self.events is not None:
            self.events.close()
        self.push.close()
        if self.inputs is not None:
            self.inputs.close()
        self.link.close()
