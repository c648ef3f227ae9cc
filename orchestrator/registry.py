"""The workers the orchestrator knows: who they are, where they listen, how loaded, whether alive.

    ready ──heartbeat says its loop has not finished a step for stall_timeout_s──▶ stalled
      ▲ ◀──────────────────────────── a heartbeat with recent progress ───────────┘
      └── registers again ◀── dead ◀── no heartbeat for worker_timeout_s (from ready or stalled)
    ready / stalled ──Drain──▶ draining ──Leaving──▶ forgotten     (or ──silence──▶ dead)


Heartbeats come from a thread of their own (common/worker_link.py), so `dead` means the process
is stopped, gone, wedged or cut off, never merely busy; `stalled` means alive but not
progressing: it keeps its requests, and new work goes to ready workers first. `draining` is alive
and gets no new work at all: it finishes what it holds (a context worker's leases stay readable,
so it stays a KV peer), then says it is leaving and is forgotten. A dead worker heard
from again is asked to register again (orchestrator.py says why), and a restarted one registers
under its old id: either way its new registration replaces the record.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import msgspec

from common.protocol import Heartbeat, KVPool, Register, WorkerInfo, WorkerStats

logger = logging.getLogger(__name__)

FORGET_AFTER_TIMEOUTS = 12  # a dead record stays listed for this many worker timeouts (60 s)


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    role: str
    pid: int
    address: str
    kv_pool: KVPool | None
    last_seen: float
    events_address: str = ""
    instance: str = ""  # Register.instance: which process start this record is
    state: str = "ready"  # ready | stalled | draining | dead
    progress_age_s: float = 0.0  # from its last heartbeat
    stats: WorkerStats = field(default_factory=WorkerStats)
    active_tokens: int = 0  # prompt + max_tokens of the requests routed here and not yet ended
    request_ids: set[str] = field(default_factory=set)
    requests_routed: int = 0  # requests assigned here since it registered (a total)
    # prompts sent here to be prefilled where they decode (a total), and of those the ones sent
    # since its last heartbeat, which its stats' num_waiting cannot count yet
    local_prefills_routed: int = 0
    local_prefills_unreported: int = 0
    drain_in_flight_told: int | None = None  # draining: the Drain.in_flight last sent to it

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def alive(self) -> bool:
        return self.state != "dead"

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    def info(self, now: float) -> WorkerInfo:
        stats = msgspec.structs.asdict(self.stats)
        stats["active_requests"] = max(len(self.request_ids), self.stats.active_requests)
        return WorkerInfo(
            **stats,
            worker_id=self.worker_id,
            role=self.role,
            pid=self.pid,
            address=self.address,
            state=self.state,
            requests_routed=self.requests_routed,
            local_prefills_routed=self.local_prefills_routed,
            events_address=self.events_address,
            last_heartbeat_s=round(now - self.last_seen, 3),
            progress_age_s=self.progress_age_s,
        )


class Registry:
    """The records, and each role's ready and live workers, kept between changes: routing asks
    for them several times per request and the peer check after every message, so a scan of
    every record each time made each message O(workers)."""

    def __init__(self, worker_timeout_s: float, stall_timeout_s: float) -> None:
        self.worker_timeout_s = worker_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.workers: dict[str, WorkerRecord] = {}  # changed only by the methods below
        self.version = 0  # +1 whenever a record is added, replaced or dropped, or changes state
        self._by_role: dict[tuple[str, bool], tuple[WorkerRecord, ...]] = {}

    def _changed(self) -> None:
        self.version += 1
        self._by_role.clear()

    def register(self, message: Register, now: float) -> WorkerRecord | None:
        """Add (or replace) a worker; returns the record it replaced, if any."""
        old = self.workers.get(message.worker_id)
        self.workers[message.worker_id] = WorkerRecord(
            worker_id=message.worker_id,
            role=message.role,
            pid=message.pid,
            address=message.address,
            kv_pool=message.kv_pool,
            last_seen=now,
            events_address=message.events_address,
            instance=message.instance,
        )
        self._changed()
        return old

    def heartbeat(self, message: Heartbeat, now: float) -> WorkerRecord | None:
        """Record a heartbeat and the state it implies; None when the worker is unknown (it
        must register again). A dead worker stays dead until it registers again."""
        worker = self.workers.get(message.worker_id)
        if worker is None:
            return None
        worker.last_seen = now
        if not worker.alive:
            return worker
        worker.progress_age_s = message.progress_age_s
        if message.stats is not None:
            worker.stats = message.stats
            worker.local_prefills_unreported = 0
        if worker.draining:
            return worker  # until it leaves: progress or not, it takes no new work
        state = "stalled" if message.progress_age_s > self.stall_timeout_s else "ready"
        if state != worker.state:
            log = logger.warning if state == "stalled" else logger.info
            log("%s %s is %s (its loop last finished a step %.1f s ago)", worker.role,
                worker.worker_id, state, message.progress_age_s)  # fmt: skip
            worker.state = state
            self._changed()
        return worker

    def drain(self, worker_id: str) -> WorkerRecord | None:
        """Mark a live worker draining; None when there is no such live worker."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return None
        if not worker.draining:
            logger.info("%s %s is draining: no new work goes to it", worker.role, worker_id)
            worker.state = "draining"
            self._changed()
        return worker

    def leave(self, worker_id: str) -> WorkerRecord | None:
        """Forget a worker that left on purpose; the record, or None if it was not known."""
        worker = self.workers.pop(worker_id, None)
        self._changed()
        return worker

    def expire(self, now: float) -> list[WorkerRecord]:
        """Mark workers silent for too long as dead; returns the newly dead."""
        dead = [
            w
            for w in self.workers.values()
            if w.alive and now - w.last_seen > self.worker_timeout_s
        ]
        for worker in dead:
            worker.state = "dead"
        if dead:
            self._changed()
        return dead

    def forget_dead(self, now: float) -> None:
        """Drop records dead for FORGET_AFTER_TIMEOUTS worker timeouts (a worker scaled away, a
        pod gone): /cluster_info lists the cluster as it is. One that comes back after that is
        asked to register again."""
        forget_after_s = FORGET_AFTER_TIMEOUTS * self.worker_timeout_s
        for worker in [w for w in self.workers.values() if not w.alive]:
            if now - worker.last_seen > forget_after_s:
                logger.info("%s %s: dead for %.0f s, forgotten", worker.role, worker.worker_id,
                            now - worker.last_seen)  # fmt: skip
                del self.workers[worker.worker_id]
                self._changed()

    def ready(self, role: str) -> tuple[WorkerRecord, ...]:
        return self._with_role(role, ready_only=True)

    def live(self, role: str) -> tuple[WorkerRecord, ...]:
        """Ready, stalled or draining: alive, so still a peer and still holding its requests."""
        return self._with_role(role, ready_only=False)

    def routable(self, role: str) -> tuple[WorkerRecord, ...]:
        """Where new work goes: the ready workers, or, when every live one is stalled, those
        (a request queued on a slow worker beats a 503); never a draining one."""
        return self.ready(role) or tuple(w for w in self.live(role) if not w.draining)

    def _with_role(self, role: str, ready_only: bool) -> tuple[WorkerRecord, ...]:
        """By worker id; computed once per change of the registry."""
        found = self._by_role.get((role, ready_only))
        if found is None:
            found = self._by_role[(role, ready_only)] = tuple(
                sorted(
                    (w for w in self.workers.values()
                     if w.role == role and (w.ready if ready_only else w.alive)),
                    key=lambda w: w.worker_id,
                )
            )  # fmt: skip
        return found

    def postproc_for(self, request_id: str) -> WorkerRecord | None:
        """A stable choice (crc32 of the id, not Python's salted hash) over the routable pool."""
        pool = self.routable("postproc")
        if not pool:
            return None
        return pool[zlib.crc32(request_id.encode()) % len(pool)]

    def kv_pools(self) -> list[KVPool]:
        return [w.kv_pool for w in self.live("context") if w.kv_pool is not None]
