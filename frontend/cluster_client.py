"""The frontend's side of the cluster: submit GenerateRequests, receive their chunks, abort.

    GenerateRequest / Abort / ClusterInfoRequest / Profile ──DEALER──▶ orchestrator
    RequestFailed / ClusterInfo / ProfileDone ◀──────────────DEALER─── orchestrator
    Chunk ◀────────────────────────────────────────PULL───── postproc workers (at `reply_to`)

Each open request has an asyncio.Queue that the two reader tasks fill; the route handler reads
it. The frontend registers with the orchestrator like a worker (role "frontend") so that
/cluster_info lists it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections import defaultdict, deque
from typing import Any, Literal, TypeVar

import zmq
import zmq.asyncio

from common.block_hash import block_hashes
from common.config import ClusterConfig
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Chunk,
    ClusterInfo,
    ClusterInfoRequest,
    DrainKVEvents,
    GenerateRequest,
    Heartbeat,
    KVEventsDrained,
    LoRACommand,
    LoRADone,
    Message,
    Profile,
    ProfileDone,
    Refused,
    Register,
    RegisterAgain,
    RequestFailed,
    WorkerStats,
    decode_token_ids,
    encode,
)
from common.transport import async_recv, async_send, bind_random_port, make_socket

logger = logging.getLogger(__name__)

Event = Chunk | RequestFailed
T = TypeVar("T")


class ClusterClient:
    def __init__(
        self, config: ClusterConfig, worker_id: str, http_url: str, context: zmq.asyncio.Context
    ) -> None:
        """`context`: the process's (secured by the entry point when CURVE is on)."""
        self.config = config
        self.worker_id = worker_id
        self.context = context
        self.dealer = make_socket(self.context, zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.dealer.connect(config.orchestrator.address)
        self.chunks = make_socket(self.context, zmq.PULL)
        self.reply_to = bind_random_port(
            self.chunks, config.internal_host, config.advertise_host, config.port_range
        )
        self.register_message = Register(
            worker_id=worker_id,
            role="frontend",
            protocol_version=PROTOCOL_VERSION,
            pid=os.getpid(),
            address=http_url,
        )
        self.open: dict[str, asyncio.Queue[Event]] = {}
        # Replies from the orchestrator come in request order, per kind: FIFO waiters per type.
        self._waiters: dict[type, deque[asyncio.Future[Any]]] = defaultdict(deque)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await async_send(self.dealer, self.register_message)
        self._tasks = [
            asyncio.create_task(self._read_chunks()),
            asyncio.create_task(self._read_orchestrator()),
            asyncio.create_task(self._heartbeat()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.dealer.close()
        self.chunks.close()

    async def submit(self, request: GenerateRequest) -> asyncio.Queue[Event]:
        self.add_routing_fields(request)
        frame = encode(request)  # first: a request that cannot be sent leaves no open entry
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self.open[request.request_id] = queue
        await self.dealer.send(frame)
        return queue

    def add_routing_fields(self, request: GenerateRequest) -> None:
        """What the orchestrator routes on, computed here (a frontend can be one of several
        processes; the orchestrator is one loop): the prompt's length and block hashes."""
        prompt = decode_token_ids(request.prompt_token_ids_b64)
        request.num_prompt_tokens = len(prompt)
        # the kv_aware router scores workers by them; with the offload tier the orchestrator
        # also finds a peer's tier holding the prompt by them
        if self.config.orchestrator.router == "kv_aware" or self.config.kv_cache.offload.enabled:
            request.prompt_block_hashes = block_hashes(
                prompt, self.config.kv_cache.block_size, request.extra_keys
            )

    def abort(self, request_id: str) -> None:
        """The client went away: stop the request everywhere (a no-op if it already ended).

        Not a coroutine: it runs in `finally` blocks of cancelled tasks, where an await would
        raise before sending. A NOBLOCK send on an idle socket goes out at once.
        """
        if self.open.pop(request_id, None) is not None:
            self.dealer.send(encode(Abort(request_id=request_id, reason="client")), zmq.NOBLOCK)

    def done(self, request_id: str) -> None:
        self.open.pop(request_id, None)

    async def cluster_info(self, timeout_s: float) -> ClusterInfo | None:
        """The orchestrator's table, or None when it does not answer in time."""
        return await self._ask(ClusterInfoRequest(), ClusterInfo, timeout_s)

    async def drain_kv_events(self, timeout_s: float) -> KVEventsDrained | None:
        return await self._ask(DrainKVEvents(), KVEventsDrained, timeout_s)

    async def profile(
        self, action: Literal["start", "stop"], timeout_s: float
    ) -> ProfileDone | None:
        """Every engine worker's answer to POST /start_profile or /stop_profile, merged."""
        return await self._ask(Profile(action=action), ProfileDone, timeout_s)

    async def lora(self, command: LoRACommand, timeout_s: float) -> LoRADone | None:
        """Every engine worker's answer to a LoRA adapter load or unload, merged."""
        return await self._ask(command, LoRADone, timeout_s)

    async def _ask(self, question: Message, answer: type[T], timeout_s: float) -> T | None:
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters[answer].append(waiter)
        await async_send(self.dealer, question)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return None  # wait_for cancelled the waiter: a late answer goes to the next one

    async def _read_chunks(self) -> None:
        while True:
            message = await async_recv(self.chunks, "a postproc worker")
            if isinstance(message, Chunk):
                self._deliver(message.request_id, message)

    async def _read_orchestrator(self) -> None:
        while True:
            message = await async_recv(self.dealer, "the orchestrator")
            self._on_orchestrator(message)

    def _on_orchestrator(self, message: Message | None) -> None:
        if isinstance(message, RequestFailed):
            self._deliver(message.request_id, message)
        elif isinstance(message, ClusterInfo | KVEventsDrained | ProfileDone | LoRADone):
            waiters = self._waiters[type(message)]
            while waiters:  # answers come in order; skip waiters that timed out
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(message)
                    break
        elif isinstance(message, RegisterAgain):
            asyncio.create_task(async_send(self.dealer, self.register_message))
        elif isinstance(message, Refused):
            logger.error("registration refused: %s", message.reason)
            sys.exit(2)

    def _deliver(self, request_id: str, event: Event) -> None:
        queue = self.open.get(request_id)
        if queue is not None:  # else the client left and the request was aborted
            queue.put_nowait(event)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.orchestrator.heartbeat_interval_seconds)
            stats = WorkerStats(active_requests=len(self.open))
            await async_send(self.dealer, Heartbeat(worker_id=self.worker_id, stats=stats))
