"""The postproc worker's loop: TokenBatches in, OpenAI bytes out to the frontend that owns each
request (a Chunk to its `reply_to`), and Abort(reason="stop") upstream when a stop string ends a
request that is still decoding.

Requests are spread over the pool by the orchestrator (a stable hash of the request id), so all
of one request's batches reach the same worker and its state lives in one place. Socket-free
(common/worker_process.py drives it, TokenBatches from its PULL socket, Aborts from the
orchestrator): `handle()` returns what to send.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from common.errors import error_body
from common.protocol import (
    FAILED,
    Abort,
    Chunk,
    Message,
    TokenBatch,
    WorkerStats,
    unpack_postproc_start,
)
from common.tokenizer import Tokenizer
from common.worker_process import ORCHESTRATOR, Outbox
from postproc_worker.formatter import RequestState

logger = logging.getLogger(__name__)

POLL_MS = 100
# A draining worker leaves only after this long without a batch: a request's last batch and
# its RequestFinished leave the generation worker on different sockets, and the orchestrator's
# Drain.in_flight can reach 0 just before the batch arrives.
DRAIN_QUIET_S = 1.0


class PostprocWorker:
    """`clock`: what the worker reads the time from (time.monotonic; tests pass their own)."""

    def __init__(self, tokenizer: Tokenizer, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.reply_to: dict[str, str] = {}
        self.last_batch_at = clock()
        self.out: Outbox = []  # what the current handle() sends

    def stats(self) -> WorkerStats:
        return WorkerStats(active_requests=len(self.requests))

    def wait_ms(self) -> int:
        return POLL_MS

    def handle(self, message: Message, now: float) -> Outbox:
        if isinstance(message, TokenBatch):
            self.last_batch_at = now
            self.process(message)
        elif isinstance(message, Abort) and message.request_id in self.requests:
            self.end(message.request_id, upstream=False)  # it failed elsewhere
        out, self.out = self.out, []
        return out

    def step(self, now: float) -> Outbox:
        return []  # all its work comes with messages

    def process(self, batch: TokenBatch) -> None:
        for packed in batch.starts:
            try:
                start = unpack_postproc_start(packed)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped a malformed PostprocStart (%d bytes): %s", len(packed), exc)
                continue  # its tokens are dropped as never announced
            self.requests[start.request_id] = RequestState(start, self.tokenizer)
            self.reply_to[start.request_id] = start.reply_to
        for delta in batch.deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue  # already done (a stop string ended it), or never announced
            if delta.finish_reason == FAILED:
                self.end(delta.request_id, upstream=False)  # the orchestrator tells the frontend
                continue
            try:
                out = state.add(delta)
            except Exception:  # a formatter bug must cost one request, not the worker
                logger.exception("%s: post-processing failed; ending the request", delta.request_id)
                body = error_body(500, "post-processing failed", code="postproc_error")
                failed = Chunk(request_id=delta.request_id, data=body, done=True, status_code=500)
                self.out.append((self.reply_to[delta.request_id], failed))
                self.end(delta.request_id, upstream=True)
                continue
            address = self.reply_to[delta.request_id]
            if not out.done:
                if out.data:
                    self.out.append((address, Chunk(request_id=delta.request_id, data=out.data)))
                continue
            ending = Chunk(
                request_id=delta.request_id,
                data=out.data,
                done=True,
                prompt_tokens=state.billed_prompt_tokens,
                cached_tokens=state.billed_cached_tokens,
                completion_tokens=state.num_completion_tokens,
                times=state.times,
            )
            self.out.append((address, ending))
            self.end(delta.request_id, upstream=out.abort_upstream)

    def idle(self, now: float) -> bool:
        """No stream open here (the orchestrator's Drain.in_flight counts the ones not here
        yet), and no batch lately."""
        return not self.requests and now - self.last_batch_at > DRAIN_QUIET_S

    def end(self, request_id: str, upstream: bool) -> None:
        del self.requests[request_id], self.reply_to[request_id]
        if upstream:
            self.out.append((ORCHESTRATOR, Abort(request_id=request_id, reason="stop")))

    def close(self) -> None:
        pass  # it holds no resource; the process closes its sockets
