"""The postproc worker's loop: TokenBatches in (PULL), OpenAI bytes out to the frontend that owns
each request (PUSH to its `reply_to`), and Abort(reason="stop") upstream when a stop string ends a
request that is still decoding.

Requests are spread over the pool by the orchestrator (a stable hash of the request id), so all
of one request's batches reach the same worker and its state lives in one place.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from common.builtin_models import resolve_model_dir
from common.config import ClusterConfig
from common.cpu_placement import place_light_process
from common.errors import error_body
from common.protocol import (
    FAILED,
    PROTOCOL_VERSION,
    Abort,
    Chunk,
    Register,
    Registered,
    TokenBatch,
    WorkerStats,
)
from common.tokenizer import load_tokenizer
from common.transport import bind_random_port, make_socket, recv
from common.worker_link import OrchestratorLink, PushSockets
from postproc_worker.formatter import RequestState

logger = logging.getLogger(__name__)

POLL_MS = 100
# A draining worker leaves only after this long without a batch: a request's last batch and
# its RequestFinished leave the generation worker on different sockets, and the orchestrator's
# Drain.in_flight can reach 0 just before the batch arrives.
DRAIN_QUIET_S = 1.0


class PostprocWorker:
    def __init__(self, config: ClusterConfig, worker_id: str, context: zmq.Context) -> None:
        self.tokenizer = load_tokenizer(resolve_model_dir(config.model, config.dtype))
        place_light_process(config)  # off the engines' cores, once the start-up work is done
        self.tokens = make_socket(context, zmq.PULL)
        self.address = bind_random_port(
            self.tokens, config.internal_host, config.advertise_host, config.port_range
        )
        self.requests: dict[str, RequestState] = {}
        self.reply_to: dict[str, str] = {}
        self.push = PushSockets(context)
        self.last_batch_at = time.monotonic()
        register = Register(
            worker_id=worker_id,
            role="postproc",
            protocol_version=PROTOCOL_VERSION,
            pid=os.getpid(),
            address=self.address,
        )
        self.link = OrchestratorLink(context, config.orchestrator, register, self.stats)
        self.poller = zmq.Poller()
        self.poller.register(self.tokens, zmq.POLLIN)
        self.poller.register(self.link.socket, zmq.POLLIN)

    def stats(self) -> WorkerStats:
        return WorkerStats(active_requests=len(self.requests))

    def on_registered(self, registered: Registered) -> None:
        logger.info("receiving tokens at %s", self.address)

    def step(self) -> None:
        self.poller.poll(POLL_MS)
        for command in self.link.receive():
            if isinstance(command, Abort) and command.request_id in self.requests:
                self.end(command.request_id, upstream=False)  # it failed elsewhere
        while (message := recv(self.tokens, "a worker")) is not None:
            if isinstance(message, TokenBatch):
                self.last_batch_at = time.monotonic()
                self.process(message)
        self.link.progress()

    def process(self, batch: TokenBatch) -> None:
        for request in batch.first:
            self.requests[request.request_id] = RequestState(request, self.tokenizer)
            self.reply_to[request.request_id] = request.reply_to
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
                self.push.send(self.reply_to[delta.request_id], failed)
                self.end(delta.request_id, upstream=True)
                continue
            address = self.reply_to[delta.request_id]
            text = out.data[: len(out.data) - len(out.ending)]
            if text:
                self.push.send(address, Chunk(request_id=delta.request_id, data=text))
            if out.done:
                ending = Chunk(
                    request_id=delta.request_id,
                    data=out.ending,
                    done=True,
                    prompt_tokens=state.billed_prompt_tokens,
                    completion_tokens=state.num_completion_tokens,
                    times=state.times,
                )
                self.push.send(address, ending)
                self.end(delta.request_id, upstream=out.abort_upstream)

    def idle(self) -> bool:
        """No stream open here (the orchestrator's Drain.in_flight counts the ones not here
        yet), and no batch lately."""
        return not self.requests and time.monotonic() - self.last_batch_at > DRAIN_QUIET_S

    def end(self, request_id: str, upstream: bool) -> None:
        del self.requests[request_id], self.reply_to[request_id]
        if upstream:
            self.link.send(Abort(request_id=request_id, reason="stop"))

    def close(self) -> None:
        self.push.close()
        self.tokens.close()
        self.link.close()
