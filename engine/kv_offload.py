"""The KV offload tier: prefix-cache blocks the device pool evicts, kept in host memory (and on
disk) so a later prompt with the same prefix copies them back instead of recomputing them.

    device pool (engine/block_pool.py)   host tier (HostTier)            disk tier (kv_disk_tier.py)
    ──────────────────────────────────   ─────────────────────────────   ───────────────────────────
    a cached-free block is evicted  ───▶ slot ← copy of the block    ───▶ LRU slot evicted: file
                                         (skipped if already held)         (if a disk tier is set)
    prefix miss on block i          ◀─── restore: fresh pool block ◀─── or read back from its file
                                         ← copy; the slot stays (inclusive)

Keys are the prefix cache's chained block hashes, so a tier hit is exactly a prefix-cache hit. The
copies are torch copies between the pool's block and a slot of the same shape and dtype: a host
pool on CPU, pinned memory under a CUDA pool. Each level is bounded (bytes → whole blocks) and
evicts least recently used first. Events report each level's gains and losses as vLLM's `medium`
("CPU", "DISK"; the pool's are "GPU" whatever the device, as vLLM's and Dynamo's routers expect).
A tier's BlockStored carries the hashes only (no tokens, no parent), as vLLM's offloading connector
sends them: the tokens were reported when the block first entered the pool.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from common.config import KVOffloadConfig
from common.kv_events import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored, KVEvent
from engine.kv_disk_tier import DiskTier

logger = logging.getLogger(__name__)


def signed64(block_hash: int) -> int:
    """A block hash (unsigned 64-bit) as the int64 the directory stores."""
    return block_hash - (1 << 64) if block_hash >= 1 << 63 else block_hash


class HostTier:
    """A fixed slab of `num_slots` blocks in host memory, indexed by block hash, LRU.

    `directory[slot]` says which hash the slot holds (0: none or being written) for peers that
    read the slab over NIXL without asking (engine/kv_tier_share.py). A slot is rewritten as
    directory 0 → data → directory hash, so a reader that sees the same hash before and after
    its read of the data got that block whole.
    """

    def __init__(self, block_shape: torch.Size, dtype: torch.dtype, num_slots: int, pin: bool):
        if num_slots < 1:
            raise ValueError("the host tier must hold at least one block")
        # (num_slots, num_layers, 2, block_size, num_kv_heads, row): the pool's block layout
        self.slots = torch.zeros((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self.directory = torch.zeros(num_slots, dtype=torch.int64)  # signed64(hash) per slot
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def hashes(self) -> list[int]:
        return list(self._slot_of)

    def slot(self, block_hash: int) -> int | None:
        """The slot holding the hash (marked most recently used), or None."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
        return slot

    def take_slot(self) -> tuple[int, tuple[int, torch.Tensor] | None]:
        """A slot to write, out of the index (directory 0), and the LRU entry evicted for it as
        (hash, the slot's data): a view, valid only until the slot is written."""
        evicted = None
        if not self._free:
            old, slot = self._slot_of.popitem(last=False)
            self.directory[slot] = 0
            evicted = (old, self.slots[slot])
            self._free.append(slot)
        return self._free.pop(), evicted

    def adopt(self, slot: int, block_hash: int) -> None:
        """A slot from take_slot, now written, holds `block_hash`."""
        self._slot_of[block_hash] = slot
        self.directory[slot] = signed64(block_hash)

    def give_back(self, slot: int) -> None:
        """A slot from take_slot that was not written after all."""
        self._free.append(slot)

    def clear(self) -> None:
        self._free.extend(self._slot_of.values())
        self._slot_of.clear()
        self.directory.zero_()


class KVOffload:
    """The tiers behind one engine's pool: `offload` on eviction, `restore` on a prefix miss."""

    def __init__(self, pool: torch.Tensor, config: KVOffloadConfig) -> None:
        self.pool = pool  # (num_blocks, *block_shape), engine/kv_cache.py
        block_num_bytes = pool[0].numel() * pool.element_size()
        num_slots = config.host_bytes // block_num_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_cache.offload.host_bytes {config.host_bytes} holds no"
                f" {block_num_bytes}-byte block"
            )
        self.host = HostTier(pool.shape[1:], pool.dtype, num_slots, pin=pool.is_cuda)
        self.disk = (
            DiskTier(config.disk_path, config.disk_bytes, block_num_bytes, pin=pool.is_cuda)
            if config.disk_path and config.disk_bytes > 0
            else None
        )
        self.block_size = pool.shape[3]
        self._events: list[KVEvent] = []
        self.num_offloaded_blocks = 0  # copied from the pool into the host tier
        self.num_restored_blocks = 0  # copied back into the pool instead of recomputed
        self.num_disk_restored_blocks = 0  # ... of which read from the disk tier

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.host or (self.disk is not None and block_hash in self.disk)

    def offload(self, block_id: int, block_hash: int) -> None:
        """The pool is evicting `block_id` (its KV still valid): keep a copy under its hash."""
        if self.host.slot(block_hash) is not None:
            return  # restored from here earlier and unchanged since: the copy is current
        slot, evicted = self.host.take_slot()
        self._spill(evicted)  # before the slot is overwritten: the disk tier copies it
        self.host.slots[slot].copy_(self.pool[block_id])
        self.host.adopt(slot, block_hash)
        self.num_offloaded_blocks += 1
        self._record(BlockStored([block_hash], None, [], self.block_size, medium=MEDIUM_CPU))

    def reserve_slots(self, num_slots: int) -> list[int]:
        """Host slots for blocks a peer's tier will write (engine/kv_tier_share.py); each is then
        adopted (`adopt`) or given back (`give_back`)."""
        slots = []
        for _ in range(min(num_slots, self.host.slots.shape[0])):
            slot, evicted = self.host.take_slot()
            self._spill(evicted)
            slots.append(slot)
        return slots

    def adopt(self, slot: int, block_hash: int) -> None:
        self.host.adopt(slot, block_hash)
        self._record(BlockStored([block_hash], None, [], self.block_size, medium=MEDIUM_CPU))

    def give_back(self, slot: int) -> None:
        self.host.give_back(slot)

    def _spill(self, evicted: tuple[int, torch.Tensor] | None) -> None:
        """A block the host tier evicted goes to the disk tier, if any."""
        if evicted is None:
            return
        old, data = evicted
        self._record(BlockRemoved([old], medium=MEDIUM_CPU))
        if self.disk is None or old in self.disk:
            return
        dropped = self.disk.put(old, data)
        if dropped is None:
            return  # the writer is behind: the block is simply not kept
        if dropped:
            self._record(BlockRemoved(dropped, medium=MEDIUM_DISK))
        self._record(BlockStored([old], None, [], self.block_size, medium=MEDIUM_DISK))

    def restore(self, block_hash: int, block_id: int) -> bool:
        """Copy the block held under `block_hash` into pool block `block_id`; False if no level
        has it (or its file could not be read): the caller recomputes it."""
        slot = self.host.slot(block_hash)
        if slot is not None:
            self.pool[block_id].copy_(self.host.slots[slot])
        elif self.disk is not None and self.disk.read_into(block_hash, self.pool[block_id]):
            self.num_disk_restored_blocks += 1
        else:
            return False
        self.num_restored_blocks += 1
        return True

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset: its hashes no longer mean anything)."""
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        self._events.clear()  # about hashes the AllBlocksCleared that follows drops anyway

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def _record(self, event: BlockStored | BlockRemoved) -> None:
        # Extend the pending event of the same kind and medium: one event per step and level.
        last = self._events[-1] if self._events else None
        if type(last) is type(event) and last.medium == event.medium:  # type: ignore[union-attr]
            last.block_hashes.extend(event.block_hashes)  # type: ignore[union-attr]
        else:
            self._events.append(event)
