"""The workers the orchestrator knows: who they are, where they listen, how loaded, whether alive.

A worker is `ready` from its Register until its heartbeats stop for `worker_timeout_s`, then
`dead`; a heartbeat from a dead worker (it was only slow) makes it ready again. A restarted
worker registers under its old id and replaces its record.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import msgspec

from common.protocol import KVPool, Register, WorkerInfo, WorkerStats


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    role: str
    pid: int
    address: str
    kv_pool: KVPool | None
    last_seen: float
    events_address: str = ""
    state: str = "ready"  # ready | dead
    stats: WorkerStats = field(default_factory=WorkerStats)
    active_tokens: int = 0  # prompt + max_tokens of the requests routed here and not yet ended
    request_ids: set[str] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

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
            events_address=self.events_address,
            last_heartbeat_s=round(now - self.last_seen, 3),
        )


class Registry:
    def __init__(self, worker_timeout_s: float) -> None:
        self.worker_timeout_s = worker_timeout_s
        self.workers: dict[str, WorkerRecord] = {}

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
        )
        return old

    def heartbeat(self, worker_id: str, stats: WorkerStats | None, now: float) -> bool:
        """Record a heartbeat; False when the worker is unknown (it must register again)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return False
        worker.last_seen = now
        worker.state = "ready"
        if stats is not None:
            worker.stats = stats
        return True

    def expire(self, now: float) -> list[WorkerRecord]:
        """Mark workers silent for too long as dead; returns the newly dead."""
        dead = [
            w
            for w in self.workers.values()
            if w.ready and now - w.last_seen > self.worker_timeout_s
        ]
        for worker in dead:
            worker.state = "dead"
        return dead

    def ready(self, role: str) -> list[WorkerRecord]:
        return sorted(
            (w for w in self.workers.values() if w.role == role and w.ready),
            key=lambda w: w.worker_id,
        )

    def postproc_for(self, request_id: str) -> WorkerRecord | None:
        """A stable choice (crc32 of the id, not Python's salted hash) over the live pool."""
        pool = self.ready("postproc")
        if not pool:
            return None
        return pool[zlib.crc32(request_id.encode()) % len(pool)]

    def kv_pools(self) -> list[KVPool]:
        return [w.kv_pool for w in self.ready("context") if w.kv_pool is not None]
