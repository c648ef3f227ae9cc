"""KV blocks between workers over NIXL (UCX backend): one READ per request, then a notification.

Each worker registers its whole block-major KV pool once (engine/kv_cache.py: block i is the bytes
at `base_address + i * block_num_bytes`) and tells its peers its `KVPool` once, at registration.
A generation worker then pulls any set of a context worker's blocks with one transfer request:

    context worker (source)                          generation worker (reader)
    ───────────────────────                          ──────────────────────────
    prefill into blocks [7, 3, 9]; lease them
    ── block ids + agent name (ZMQ) ───────────▶  allocate local blocks [0, 1, 2]
                                                  start_read(peer, [7, 3, 9], [0, 1, 2], b"req-1")
           blocks 7, 3, 9  ═══ one NIXL READ ══▶  local 0, 1, 2 (written by the READ)
                                                  poll() == "done": local blocks valid from here
    take_notifications() ◀── b"req-1" ─────────── sent by NIXL itself once the READ completed
    free the lease on [7, 3, 9]

Who frees what, when:
- The source keeps its blocks leased until the notification arrives or the lease times out; never
  earlier, since the reader's READ may still be in flight.
- The reader owns its local blocks throughout. They hold garbage until poll() says "done". On
  "failed" (an error, or `timeout_s`, which must be shorter than the source's lease) release()
  cancels the READ; only then may the reader free or reuse them. A failed READ sends no
  notification: the source's lease expiry (or an abort routed by the orchestrator) frees its blocks.

On one host with DRAM pools UCX copies with CMA (process_vm_readv) inside start_read itself
(about 1 GiB/s measured on the 2-core dev VM), so a large READ holds the loop for its length and
poll() then just sees "done"; over TCP or RDMA the copy proceeds in the background.

A `KVTransferAgent` is not thread-safe: one worker loop owns it (NIXL runs with thread sync off).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from nixl import _bindings as nixl_bindings
from nixl._api import (
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_xfer_handle,
)

from common.protocol import KVPool, TierRegion

logger = logging.getLogger(__name__)

TransferState = Literal["pending", "done", "failed"]

# nixl_agent hard-codes a 0 µs progress-thread delay, so the UCX progress thread polls in a tight
# loop: one whole core per worker (measured). The thread itself is needed: without it a READ stalls
# (2.5 s, then >10 s, measured) while the source process is busy and not driving UCX, because the
# source serves connection set-up, notifications and, without CMA, the TCP get. The delay is the
# timeout of the thread's wait on UCX's event fd, which an event ends at once: it only bounds how
# often an idle thread wakes. At 1 ms (1,000 wake-ups a second on the engine's pinned core) a
# decode step of SmolLM2 ran 8-16 % slower than with no agent (in-process A/B, alternating); at
# 100 ms no difference was measurable.
PROGRESS_THREAD_DELAY_US = 100_000
DEFAULT_TIMEOUT_S = 10.0


class KVTransferError(RuntimeError):
    """A transfer could not be set up: unknown peer, mismatched pool layout, or NIXL refused it."""


@dataclass(slots=True)
class TransferHandle:
    """One READ in flight; `num_bytes` and `seconds` are what the worker reports per request."""

    transfer_id: int
    peer_name: str
    num_blocks: int
    num_bytes: int
    started_at: float  # time.perf_counter() just before the post
    deadline: float
    state: TransferState = "pending"
    seconds: float | None = None  # post to observed completion (includes up to one poll interval)
    error: str | None = None
    xfer: nixl_xfer_handle | None = field(default=None, repr=False)


@dataclass(slots=True)
class _Peer:
    info: KVPool
    blocks: nixl_prepped_dlist_handle  # all of the peer's blocks, indexed by block id


class KVTransferAgent:
    """A worker's NIXL agent: registers its KV pool, reads peers' blocks, takes notifications."""

    def __init__(
        self, name: str, pool: torch.Tensor, block_num_bytes: int, kv_layout: str = ""
    ) -> None:
        num_blocks = pool.shape[0]
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        if pool.numel() * pool.element_size() != num_blocks * block_num_bytes:
            raise ValueError(
                f"pool of {pool.numel() * pool.element_size()} bytes is not {num_blocks} blocks"
                f" of {block_num_bytes} bytes"
            )
        self.name = name
        self.pool = pool  # keeps the registered memory alive as long as the agent
        self.num_blocks = num_blocks
        self.block_num_bytes = block_num_bytes
        self.kv_layout = kv_layout  # KVCache.layout: peers must match it, not just the byte count
        self.memory_kind = "VRAM" if pool.is_cuda else "DRAM"
        self.device_id = (pool.device.index or 0) if pool.is_cuda else 0
        self._agent = _make_nixl_agent(name)
        self._registration = self._agent.register_memory(pool)
        self._blocks = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._block_descs(pool.data_ptr(), num_blocks), self.memory_kind
        )
        self._peers: dict[str, _Peer] = {}
        self.tier: TierRegion | None = None  # set by engine/kv_tier_share.py, before info()
        self._live: dict[int, TransferHandle] = {}
        self._next_id = itertools.count()
        self._closed = False

    def info(self) -> KVPool:
        return KVPool(
            agent_name=self.name,
            agent_metadata=self._agent.get_agent_metadata(),
            base_address=self.pool.data_ptr(),
            num_blocks=self.num_blocks,
            block_num_bytes=self.block_num_bytes,
            kv_layout=self.kv_layout,
            device_id=self.device_id,
            memory_kind=self.memory_kind,
            tier=self.tier,
        )

    @property
    def peer_names(self) -> list[str]:
        return list(self._peers)

    @property
    def nixl(self) -> nixl_agent:
        """The NIXL agent itself, for engine/kv_tier_share.py's registrations and READs."""
        return self._agent

    def add_peer(self, peer: KVPool) -> None:
        """Load a peer's metadata and prepare its block list once; each READ then picks indices."""
        if peer.block_num_bytes != self.block_num_bytes:
            raise KVTransferError(
                f"peer {peer.agent_name!r} has {peer.block_num_bytes}-byte blocks, this worker"
                f" {self.block_num_bytes}: model, dtype or block_size differ"
            )
        if peer.kv_layout != self.kv_layout:  # same bytes, other contents: read as garbage
            raise KVTransferError(
                f"peer {peer.agent_name!r} stores its KV as {peer.kv_layout or 'unstated'!r},"
                f" this worker as {self.kv_layout or 'unstated'!r}: kv_cache.dtype, model or"
                " block_size differ"
            )
        if peer.memory_kind not in ("DRAM", "VRAM"):
            raise KVTransferError(
                f"peer {peer.agent_name!r}: unknown memory kind {peer.memory_kind!r}"
            )
        if peer.agent_name in self._peers:  # a restarted worker re-registers under its old name
            self.remove_peer(peer.agent_name)
        try:
            loaded = self._agent.add_remote_agent(peer.agent_metadata)
        except Exception as e:  # NIXL connects to the peer here: a dead peer fails now
            raise KVTransferError(f"could not load peer {peer.agent_name!r}: {e!r}") from e
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded_name != peer.agent_name:
            self._agent.remove_remote_agent(loaded_name)
            raise KVTransferError(
                f"metadata names agent {loaded_name!r}, registration says {peer.agent_name!r}"
            )
        descs = self._block_descs(peer.base_address, peer.num_blocks, peer.device_id)
        try:
            blocks = self._agent.prep_xfer_dlist(peer.agent_name, descs, peer.memory_kind)
        except Exception as e:
            self._agent.remove_remote_agent(peer.agent_name)
            raise KVTransferError(f"peer {peer.agent_name!r}: blocks not readable: {e!r}") from e
        self._peers[peer.agent_name] = _Peer(peer, blocks)

    def remove_peer(self, peer_name: str) -> None:
        """Forget a peer (it left or restarted); its in-flight READs must be released first."""
        peer = self._peers.pop(peer_name, None)
        if peer is None:
            raise KVTransferError(f"unknown peer {peer_name!r}")
        peer.blocks.release()
        self._agent.remove_remote_agent(peer_name)

    def start_read(
        self,
        peer_name: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notification: bytes,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> TransferHandle:
        """Post one READ of `remote_block_ids` into `local_block_ids`; the peer gets `notification`.

        Bad ids and an unknown peer raise; failures after the post surface through poll().
        """
        peer = self._peers.get(peer_name)
        if peer is None:
            raise KVTransferError(f"unknown peer {peer_name!r}: add_peer() it first")
        remote = _check_block_ids(remote_block_ids, peer.info.num_blocks, f"peer {peer_name!r}")
        local = _check_block_ids(local_block_ids, self.num_blocks, "local")
        if len(remote) != len(local):
            raise ValueError(f"{len(remote)} remote block ids but {len(local)} local ones")
        if len(np.unique(local)) != len(local):
            raise ValueError("local block ids repeat: two blocks would be written into one")
        handle = TransferHandle(
            transfer_id=next(self._next_id),
            peer_name=peer_name,
            num_blocks=len(local),
            num_bytes=len(local) * self.block_num_bytes,
            started_at=0.0,
            deadline=0.0,
        )
        try:
            handle.xfer = self._agent.make_prepped_xfer(
                "READ", self._blocks, local, peer.blocks, remote, notification
            )
            handle.started_at = time.perf_counter()
            handle.deadline = handle.started_at + timeout_s
            status = self._agent.transfer(handle.xfer)
        except Exception as e:  # NIXL raises its own error types (nixlBackendError, ...)
            if handle.xfer is not None:
                handle.xfer.release()
            raise KVTransferError(f"READ from {peer_name!r} could not be posted: {e!r}") from e
        self._live[handle.transfer_id] = handle
        self._settle(handle, status)
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking: "pending" until the READ completes, fails, or passes its deadline."""
        if handle.state != "pending" or handle.xfer is None:
            return handle.state
        try:
            status = self._agent.check_xfer_state(handle.xfer)
        except Exception as e:  # e.g. nixlRemoteDisconnectError when the source died
            status, handle.error = "ERR", repr(e)
        self._settle(handle, status)
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        """Free the NIXL request; a pending READ is cancelled, so its local blocks are reusable."""
        self._live.pop(handle.transfer_id, None)
        xfer, handle.xfer = handle.xfer, None
        if xfer is None:
            return
        if handle.state == "pending":
            handle.state, handle.error = "failed", "released while pending"
        try:
            xfer.release()
        except Exception as e:
            raise KVTransferError(f"could not cancel READ {handle.transfer_id}: {e!r}") from e

    def notify(self, peer_name: str, message: bytes) -> None:
        """A notification without a transfer: all the reader needed was in its own prefix cache,
        yet the source must still hear that it may free its lease."""
        if peer_name not in self._peers:
            raise KVTransferError(f"unknown peer {peer_name!r}: add_peer() it first")
        try:
            self._agent.send_notif(peer_name, message)
        except Exception as e:
            raise KVTransferError(f"notification to {peer_name!r} failed: {e!r}") from e

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """(peer agent name, message) received since the last call; non-blocking."""
        notifs = self._agent.get_new_notifs()
        return [(name, msg) for name, messages in notifs.items() for msg in messages]

    def close(self) -> None:
        """Cancel what is in flight, forget peers and deregister the pool; safe to call twice.

        Each step is tried even when an earlier one fails (a dead peer, an uncancellable READ), so a
        worker shutting down always gets its registration released.
        """
        if self._closed:
            return
        self._closed = True
        steps = [lambda h=h: self.release(h) for h in list(self._live.values())]
        steps += [lambda p=p: self.remove_peer(p) for p in list(self._peers)]
        steps += [self._blocks.release, lambda: self._agent.deregister_memory(self._registration)]
        for step in steps:
            try:
                step()
            except Exception:
                logger.warning("NIXL agent %s: a close step failed", self.name, exc_info=True)

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settle(self, handle: TransferHandle, status: str) -> None:
        now = time.perf_counter()
        if status == "DONE":
            handle.state, handle.seconds = "done", now - handle.started_at
        elif status == "ERR":
            handle.state = "failed"
            handle.error = (
                handle.error or f"NIXL reported an error reading from {handle.peer_name!r}"
            )
        elif now > handle.deadline:
            handle.state = "failed"
            handle.error = f"timed out after {now - handle.started_at:.1f} s"

    def _block_descs(self, base_address: int, num_blocks: int, device_id: int = 0) -> np.ndarray:
        # (num_blocks, 3): address, length, device id; row i is block i
        descs = np.empty((num_blocks, 3), dtype=np.uint64)
        descs[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * self.block_num_bytes
        descs[:, 1] = self.block_num_bytes
        descs[:, 2] = device_id
        return descs


def _check_block_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"{side} block ids must be a non-empty flat list")
    if ids.min() < 0 or ids.max() >= num_blocks:
        bad = ids[(ids < 0) | (ids >= num_blocks)][:5].tolist()
        raise ValueError(f"{side} block ids {bad} out of range [0, {num_blocks})")
    return ids.astype(np.int32)


def _make_nixl_agent(name: str) -> nixl_agent:
    """A UCX agent whose progress thread sleeps between events (see PROGRESS_THREAD_DELAY_US).

    nixl_agent does not expose the delay, so it is built without backends and its core agent is
    replaced by one made with our config before the UCX backend is created. No listen thread and no
    port: metadata travels out of band in `KVPool`. No UCX environment variables are needed on a
    CPU-only host: UCX picks CMA (process_vm_readv) for the READ and TCP on loopback for the
    notifications, or TCP for both where CMA is not allowed.
    """
    agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=[]))
    config = nixl_bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.pthrDelay = PROGRESS_THREAD_DELAY_US
    config.syncMode = nixl_bindings.NIXL_THREAD_SYNC_NONE
    agent.agent = nixl_bindings.nixlAgent(name, config)
    agent.create_backend("UCX")
    return agent
