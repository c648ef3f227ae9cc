"""Context workers read each other's host offload tiers over NIXL: a cluster-wide prefix cache.

Each worker registers its host tier (engine/kv_offload.py's HostTier: a slab of blocks and a
directory of the hash each slot holds) with its NIXL agent beside its pool, and advertises both
in its KVPool (`tier`). The orchestrator, routing a prefill, names a peer whose tier holds more
of the prompt than the chosen worker (PrefillRequest.tier_peer); before admitting the prompt the
worker reads those blocks into its own host tier, where the engine's prefix lookup restores them
like its own. One-sided: the peer's loop takes no part.

    reader                                           peer (owns the tier, keeps serving)
    ──────                                           ──────────────────────────────────
    READ directory → scratch        ◀══ NIXL ══      directory[slot] = hash (0: being written)
    slots of the prompt's next hashes
    reserve local host slots (directory 0)
    READ those slots → local slots  ◀══ NIXL ══      slot data
    READ directory again            ◀══ NIXL ══      a slot rewritten meanwhile shows 0 or
    adopt the slots whose hash held on both reads,   another hash: its copy is dropped
    give the others back

Any failure (the peer died, a READ errs or passes `timeout_s`) gives every reserved slot back and
the prompt is computed as if no peer had it. A READ that cannot be cancelled keeps its slots out of
use for good rather than let them be written late.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.block_hash import ExtraKey, block_hashes
from common.protocol import KVPool, TierRegion
from engine.kv_cache_manager import KVCacheManager
from engine.kv_offload import KVOffload, signed64
from engine.kv_transfer import KVTransferAgent, KVTransferError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0  # a READ of a peer's tier: one whole prompt's blocks at most
POLL_INTERVAL_S = 0.0005


@dataclass(slots=True)
class _TierPeer:
    pool: KVPool
    scratch: torch.Tensor  # (num_slots,) int64: the peer's directory as last read
    scratch_registration: object
    scratch_local: object  # prepped local dlist: the scratch, one descriptor
    directory: object  # prepped remote dlist: the peer's directory, one descriptor
    slots: object  # prepped remote dlist: the peer's slots, indexed by slot


class TierShare:
    """This worker's host tier registered for peers, and the READs of peers' tiers."""

    def __init__(
        self, agent: KVTransferAgent, offload: KVOffload, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.agent, self.offload, self.timeout_s = agent, offload, timeout_s
        host = offload.host
        self.num_slots = host.slots.shape[0]
        self.block_num_bytes = host.slots[0].numel() * host.slots.element_size()
        nixl = agent.nixl
        self._registration = nixl.register_memory([host.slots, host.directory])
        self._local_slots = nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _descs(host.slots.data_ptr(), self.num_slots, self.block_num_bytes),
            "DRAM",
        )
        agent.tier = TierRegion(
            directory_address=host.directory.data_ptr(),
            slots_address=host.slots.data_ptr(),
            num_slots=self.num_slots,
        )  # advertised in the worker's registration (agent.info())
        self._peers: dict[str, _TierPeer] = {}
        self._quarantined: list[int] = []  # slots of READs that could not be cancelled
        self.num_blocks_read = 0
        self.num_failed_reads = 0

    @property
    def peer_names(self) -> list[str]:
        return list(self._peers)

    def sync_peers(self, pools: Sequence[KVPool]) -> None:
        """Prepare each peer tier once; forget the departed and the restarted (new addresses)."""
        listed = {p.agent_name: p for p in pools if p.tier is not None}
        listed.pop(self.agent.name, None)
        for name in list(self._peers):
            if listed.get(name) != self._peers[name].pool:
                self._remove(name)
        for name, pool in listed.items():
            if name not in self._peers:
                try:
                    self._add(pool)
                    logger.info("reading host tier of %s (%d slots)", name, pool.tier.num_slots)  # type: ignore[union-attr]
                except KVTransferError as e:
                    logger.error("cannot read the host tier of %s: %s", name, e)

    def fetch_prompt(
        self,
        peer_name: str,
        kv: KVCacheManager,
        token_ids: Sequence[int],
        extra_keys: tuple[ExtraKey, ...],
    ) -> int:
        """Read from the peer's tier the prompt's blocks right after what this worker holds (in
        its pool or its own tiers); returns how many came. 0 on any failure: recompute."""
        size = kv.block_size
        hashes = block_hashes(token_ids[: (len(token_ids) - 1) // size * size], size, extra_keys)
        start = 0
        while start < len(hashes) and (
            kv.pool.get_cached_block(hashes[start]) is not None or hashes[start] in self.offload
        ):
            start += 1
        if start == len(hashes):
            return 0
        return self.fetch(peer_name, hashes[start:])

    def fetch(self, peer_name: str, wanted: Sequence[int]) -> int:
        """The longest run of `wanted` (consecutive block hashes) the peer's tier holds, read into
        this worker's host tier; returns its length."""
        peer = self._peers.get(peer_name)
        if peer is None or not wanted:
            return 0
        if not self._read(peer_name, peer.scratch_local, [0], peer.directory, [0], []):
            return 0
        slot_of = {value: slot for slot, value in enumerate(peer.scratch.tolist()) if value}
        remote: list[int] = []
        for block_hash in wanted:
            slot = slot_of.get(signed64(block_hash))
            if slot is None:
                break
            remote.append(slot)
        if not remote:
            return 0
        local = self.offload.reserve_slots(len(remote))
        remote = remote[: len(local)]
        ok = self._read(peer_name, self._local_slots, local, peer.slots, remote, local)
        ok = ok and self._read(peer_name, peer.scratch_local, [0], peer.directory, [0], local)
        num_valid = 0
        if ok:
            now = peer.scratch.tolist()
            while num_valid < len(remote) and now[remote[num_valid]] == signed64(wanted[num_valid]):
                num_valid += 1
        for i, slot in enumerate(local):
            if slot in self._quarantined:
                continue
            if i < num_valid:
                self.offload.adopt(slot, wanted[i])
            else:
                self.offload.give_back(slot)
        self.num_blocks_read += num_valid
        return num_valid

    def close(self) -> None:
        """Release what was prepared and registered; before the agent itself closes."""
        for name in list(self._peers):
            self._remove(name)
        try:
            self._local_slots.release()
            self.agent.nixl.deregister_memory(self._registration)
        except Exception:
            logger.warning("could not deregister the host tier", exc_info=True)

    def _read(
        self,
        peer_name: str,
        local: object,
        local_ids: Sequence[int],
        remote: object,
        remote_ids: Sequence[int],
        slots: Sequence[int],
    ) -> bool:
        """One READ, waited for (up to timeout_s); False on any failure. `slots`: the local host
        slots it writes, quarantined if a pending READ cannot be cancelled."""
        nixl = self.agent.nixl
        xfer = None
        state = "ERR"
        try:
            xfer = nixl.make_prepped_xfer(
                "READ", local, np.asarray(local_ids, np.int32), remote,
                np.asarray(remote_ids, np.int32), b"",
            )  # fmt: skip
            state = nixl.transfer(xfer)
            deadline = time.perf_counter() + self.timeout_s
            while state not in ("DONE", "ERR") and time.perf_counter() < deadline:
                time.sleep(POLL_INTERVAL_S)
                state = nixl.check_xfer_state(xfer)
        except Exception as e:  # nixlRemoteDisconnectError and kin: the peer died
            logger.warning("host tier READ from %s failed: %r; recomputing", peer_name, e)
            state = "ERR"
        finally:
            if xfer is not None:
                try:
                    xfer.release()
                except Exception:
                    logger.warning("could not cancel a READ from %s", peer_name, exc_info=True)
                    self._quarantined.extend(slots)
        if state != "DONE":
            self.num_failed_reads += 1
            logger.warning("host tier READ from %s: %s; recomputing", peer_name, state)
        return state == "DONE"

    def _add(self, pool: KVPool) -> None:
        tier = pool.tier
        assert tier is not None
        if pool.block_num_bytes != self.block_num_bytes:
            raise KVTransferError(f"{pool.agent_name}: {pool.block_num_bytes}-byte blocks")
        if pool.agent_name not in self.agent.peer_names:
            self.agent.add_peer(pool)  # loads its metadata (and prepares its pool's blocks)
        nixl = self.agent.nixl
        scratch = torch.zeros(tier.num_slots, dtype=torch.int64)
        registration = nixl.register_memory([scratch])
        scratch_local = nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(scratch.data_ptr(), 1, tier.num_slots * 8), "DRAM"
        )
        directory = nixl.prep_xfer_dlist(
            pool.agent_name, _descs(tier.directory_address, 1, tier.num_slots * 8), "DRAM"
        )
        slots = nixl.prep_xfer_dlist(
            pool.agent_name,
            _descs(tier.slots_address, tier.num_slots, self.block_num_bytes),
            "DRAM",
        )
        self._peers[pool.agent_name] = _TierPeer(
            pool, scratch, registration, scratch_local, directory, slots
        )

    def _remove(self, name: str) -> None:
        peer = self._peers.pop(name)
        try:
            for dlist in (peer.slots, peer.directory, peer.scratch_local):
                dlist.release()  # type: ignore[attr-defined]
            self.agent.nixl.deregister_memory(peer.scratch_registration)
            if name in self.agent.peer_names:
                self.agent.remove_peer(name)
        except Exception:
            logger.warning("could not release the host tier of %s", name, exc_info=True)


def _descs(base_address: int, count: int, num_bytes: int) -> np.ndarray:
    # (count, 3): address, length, device id; row i is item i
    descs = np.empty((count, 3), dtype=np.uint64)
    descs[:, 0] = base_address + np.arange(count, dtype=np.uint64) * num_bytes
    descs[:, 1] = num_bytes
    descs[:, 2] = 0
    return descs
