"""The context worker's loop: prefill requests, sample each choice's first token, and lease the
prompt's blocks to the generation worker that will read them over NIXL.

One `step()`: take commands, free the leases whose blocks were read (or expired), run one engine
step, and answer each request whose first tokens are all sampled with a PrefillDone.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import zmq

from common.config import ClusterConfig
from common.errors import InvalidRequest
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Message,
    PrefillDone,
    PrefillRequest,
    Profile,
    ProfileDone,
    Register,
    Registered,
    RequestFailed,
    StageTimes,
    TokenBatch,
    TokenDelta,
    WorkerStats,
    decode_token_ids,
)
from common.worker_link import EXIT_ENGINE_FAULT, OrchestratorLink, PushSockets
from context_worker.leases import LeaseTable
from engine.llm_engine import TokenOutput
from engine.profiling import EngineProfiler
from engine.worker_bridge import (
    KVEventRelay,
    build_engine,
    to_delta,
    worker_stats,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 5  # NIXL notifications do not wake a zmq poll: bound their latency
FAULT_LINGER_MS = 2000  # an exiting worker's last messages get this long to go out


class ContextWorker:
    def __init__(self, config: ClusterConfig, worker_id: str, context: zmq.Context) -> None:
        self.worker_id = worker_id
        self.engine, self.agent = build_engine(config, worker_id, config.context_workers)
        self.leases = LeaseTable(config.transfer.lease_seconds)
        self.prefilling: dict[str, PrefillRequest] = {}
        self.received_at: dict[str, float] = {}  # time.monotonic(), per request prefilling
        self.first_tokens: dict[str, list[TokenDelta]] = {}
        self.push = PushSockets(context)
        self.events = KVEventRelay(config, worker_id, context)
        self.profiler = EngineProfiler(
            config.profiler.dir, worker_id, config.device, config.profiler.max_steps
        )
        register = Register(
            worker_id=worker_id,
            role="context",
            num_blocks=config.kv_cache.num_blocks,
            events_address=self.events.events_address,
            protocol_version=PROTOCOL_VERSION,
            pid=os.getpid(),
            kv_pool=self.agent.info(),
        )
        self.link = OrchestratorLink(context, config.orchestrator, register, self.stats)

    def stats(self) -> WorkerStats:
        return worker_stats(self.engine, len(self.prefilling) + len(self.leases))

    def on_registered(self, registered: Registered) -> None:
        pass  # context workers need nothing from their peers

    def step(self) -> None:
        if not self.engine.has_unfinished():
            self.link.socket.poll(IDLE_POLL_MS)
        for message in self.link.receive():
            self.handle(message)
        self.end_leases()
        if self.engine.has_unfinished():
            self.collect(self.run_engine_step())
            self.profiler.step_done()
        self.answer_profile(self.profiler.poll())
        self.events.relay(self.engine, self.link)
        self.link.progress()

    def run_engine_step(self) -> list[TokenOutput]:
        """One engine step. One that raises leaves the engine's state untrustworthy: every
        prefill in progress fails now with a 500 and the process exits for the supervisor to
        start a clean one (the seed's executor-fault boundary); a reader of one of its leases
        finds its source gone and prefills the prompt itself (transfer.recompute_on_failure)."""
        try:
            return self.engine.step()
        except Exception:
            logger.exception("engine step failed: failing %d prefills; exiting to be restarted",
                             len(self.prefilling))  # fmt: skip
            for request_id in list(self.prefilling):
                self.fail(request_id, "the context worker failed and is restarting", None, 500)
            self.link.close(linger_ms=FAULT_LINGER_MS)  # the failures must leave first
            sys.exit(EXIT_ENGINE_FAULT)

    def handle(self, message: Message) -> None:
        if isinstance(message, PrefillRequest):
            self.start(message)
        elif isinstance(message, Abort):
            self.abort(message.request_id)
        elif isinstance(message, Profile):
            self.answer_profile(self.profiler.answer(message))

    def start(self, prefill: PrefillRequest) -> None:
        request = prefill.request
        try:
            prompt = decode_token_ids(request.prompt_token_ids_b64)
            self.engine.add_request(
                request.request_id,
                prompt,
                request.sampling,
                request.extra_keys,
                prefill_only=True,
                priority=request.priority,
            )
        except InvalidRequest as e:
            self.fail(request.request_id, str(e), e.param)
            return
        except ValueError as e:
            self.fail(request.request_id, str(e), "prompt")
            return
        self.prefilling[request.request_id] = prefill
        self.received_at[request.request_id] = time.monotonic()

    def fail(
        self, request_id: str, message: str, param: str | None, status_code: int = 400
    ) -> None:
        failed = RequestFailed(
            request_id=request_id,
            status_code=status_code,
            message=message,
            code="invalid_request" if status_code == 400 else "internal_error",
            param=param,
        )
        self.link.send(failed)

    def collect(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            prefill = self.prefilling.get(out.request_id)
            if prefill is None:
                continue
            first = self.first_tokens.setdefault(out.request_id, [])
            first.append(to_delta(out))
            sampling = prefill.request.sampling
            if len(first) == (1 if sampling.beam else sampling.n):  # a beam search: its offer
                times = StageTimes(
                    queue_s=out.queue_s,
                    prefill_s=out.run_s,
                    first_token_s=time.monotonic() - self.received_at[out.request_id],
                )
                self.finish(prefill, sorted(first, key=lambda d: d.index), times)

    def finish(self, prefill: PrefillRequest, first: list[TokenDelta], times: StageTimes) -> None:
        """Lease the prompt's blocks to a reader, or, when the first tokens already end every
        choice, free them and hand the tokens to the postproc worker directly."""
        request_id = prefill.request.request_id
        del self.prefilling[request_id], self.first_tokens[request_id]
        del self.received_at[request_id]
        done = PrefillDone(
            request_id=request_id,
            worker_id=self.worker_id,
            agent_name=self.agent.name,
            first=first,
            times=times,
        )
        if done.finished:
            self.engine.release_held(request_id)
            for delta in first:
                delta.times = times
            self.push.send(
                prefill.postproc_address, TokenBatch(deltas=first, first=[prefill.request])
            )
        else:
            done.block_ids = self.engine.held_block_table(request_id)
            self.leases.add(request_id, time.monotonic())
            done.lease_s = self.leases.lease_s
        self.link.send(done)

    def end_leases(self) -> None:
        for _peer, note in self.agent.take_notifications():
            request_id = note.decode(errors="replace")
            if self.leases.release(request_id):
                self.engine.release_held(request_id)
        for request_id in self.leases.expired(time.monotonic()):
            logger.warning("%s: lease expired before its KV was read; blocks freed", request_id)
            self.engine.release_held(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)  # frees held blocks too
        self.prefilling.pop(request_id, None)
        self.received_at.pop(request_id, None)
        self.first_tokens.pop(request_id, None)
        self.leases.release(request_id)

    def idle(self) -> bool:
        """Nothing to finish: no prefill running, no lease a reader may still need."""
        return not self.prefilling and not self.leases and not self.engine.has_unfinished()

    def answer_profile(self, done: ProfileDone | None) -> None:
        if done is not None:
            self.link.send(done)

    def close(self) -> None:
        self.profiler.close()
        self.events.close()
        self.agent.close()
        self.push.close()
        self.link.close()
