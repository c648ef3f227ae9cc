"""What every registered process (workers of each role) receives from the orchestrator about
its membership: the answer to its registration, the live context workers' KV pools, and drain.

Drain also travels the other way (a worker's SIGTERM, `orchestrator drain`): the same message
asks the orchestrator to drain the worker it names.
"""

from __future__ import annotations

import msgspec

from common.protocol.wire import _Message


class TierRegion(msgspec.Struct, frozen=True, kw_only=True):
    """A context worker's host offload tier, NIXL-registered beside its pool, that its peers read
    without asking (engine/kv_tier_share.py): `num_slots` int64 hashes at `directory_address`,
    `num_slots` blocks of the pool's block_num_bytes at `slots_address`."""

    directory_address: int
    slots_address: int
    num_slots: int


class KVPool(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's NIXL-registered KV pool, exchanged once at registration."""

    agent_name: str
    agent_metadata: bytes
    base_address: int
    num_blocks: int
    block_num_bytes: int
    device_id: int = 0
    memory_kind: str = "DRAM"
    # what a block holds (engine/kv_cache.py's KVCache.layout: KV dtype, layers, block size,
    # heads, head size): a reader refuses a peer whose blocks it would read as something else
    kv_layout: str = ""
    tier: TierRegion | None = None  # its host offload tier, when kv_cache.offload is on


class Registered(_Message, tag="registered"):
    """Sent to a worker on registration, and to generation workers whenever the set of live
    context workers changes, or a heartbeat shows an older `peers_version` than the current one
    (so a lost update, or a worker that was out of touch, converges): everyone it must know."""

    peers: list[KVPool] = msgspec.field(default_factory=list)  # live context workers' pools
    peers_version: int = 0  # increases with each change of `peers`


class Refused(_Message, tag="refused"):
    """Registration refused (protocol version, duplicate id): the worker logs it and exits."""

    reason: str


class RegisterAgain(_Message, tag="register_again"):
    """A heartbeat came from a worker the orchestrator does not know (the orchestrator
    restarted)."""


class Drain(_Message, tag="drain"):
    """Take `worker_id` out of service without failing anything: no new work goes to it, what
    it holds finishes, then it leaves and exits 0.

    To the orchestrator (from the worker itself on SIGTERM, or from `orchestrator drain`): mark
    it draining. To the worker (on marking, and whenever the count changes): nothing new will
    follow this message, and `in_flight` requests in the orchestrator's table still pass through
    it (a postproc worker's may not have reached it yet); it may go once that is 0 and it holds
    nothing itself (requests, KV leases, pulls)."""

    worker_id: str
    in_flight: int = 0
