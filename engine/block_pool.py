"""Paged KV block pool: ref counts, the prefix-cache hash map, LRU eviction and KV events.

Pure Python (no torch): a block is an index into the KV tensors; this module only decides who owns
which index. Lifecycle of one block; only the pool moves a block between states:

              allocate()                           touch() (prefix hit)
  +---------+ -----------------------> +--------+ <------------------- +-------------+
  |  free   |                          | in use |                      | cached-free |
  | no hash | <----------------------- | ref>0  | -------------------> | hash, ref 0 |
  +---------+  free(): ref -> 0,       +--------+  free(): ref -> 0,   | LRU order   |
       ^       no hash                     ^        has hash           +-------------+
       |                                   |                             |      |
       |                                   +--- allocate() with no ------+      |
       |                                        plain free block left:          |
       |                                        evict the LRU one               |
       |                                        (BlockRemoved, hash dropped)    |
       +-------------- reset_prefix_cache() (AllBlocksCleared) -----------------+

cache_block() gives an in-use block its hash (BlockStored); the block keeps it until it is evicted
or the cache is reset. Invariants: free + cached_free + in_use == num_blocks; num_free_blocks (what
allocate() can hand out) == free + cached_free; a block has a hash iff the hash map points to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class NoFreeBlocksError(RuntimeError):
    """allocate() was asked for more blocks than the pool can supply; nothing was allocated."""


class BlockPool:
    """Owns every KV block of one worker: who references it, its hash, what to evict next."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Two queues so plain free blocks always go before any cached block is evicted; both are
        # ordered oldest-freed first, and an OrderedDict lets touch() unlink from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._num_used = 0
        self._events: list[KVEvent] = []
        # Called with (block id, hash) as a cached block is evicted, its KV still intact: the
        # offload tier's copy-out (engine/kv_offload.py).
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Cached-free blocks: hashed, unreferenced, kept for prefix hits until evicted."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref > 0."""
        return self._num_used

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block holding `block_hash`, in use or cached-free; takes no ref."""
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a ref on each block (prefix hits), pulling unreferenced ones off the free queues."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                queue = self._evictable if self._hash[block_id] is not None else self._free
                del queue[block_id]
                self._num_used += 1
            self._ref_cnt[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks with ref 1 and no hash, evicting LRU cached ones if needed.

        Raises NoFreeBlocksError, changing nothing, when the pool cannot supply them all.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num_blocks} blocks, only {self.num_free_blocks} free")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id, _ = self._free.popitem(last=False)
            else:
                block_id = self._evict()
            self._ref_cnt[block_id] = 1
            block_ids.append(block_id)
        self._num_used += num_blocks
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one ref on each block; `block_ids` is in sequence order (head first).

        Released in reverse so a sequence's tail enters the LRU queue first and is evicted before
        its head, which other prompts are more likely to share.
        """
        for block_id in reversed(block_ids):
            ref = self._ref_cnt[block_id]
            if ref <= 0:
                raise ValueError(f"block {block_id} freed more often than it was referenced")
            self._ref_cnt[block_id] = ref - 1
            if ref == 1:
                self._num_used -= 1
                queue = self._evictable if self._hash[block_id] is not None else self._free
                queue[block_id] = None

    def cache_block(
        self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> bool:
        """Register an in-use full block under `block_hash`; True when it entered the cache.

        If another block already holds the hash, that mapping stays and no event is emitted; this
        block then stays unhashed and returns to the plain free queue when released.
        """
        if not self.enable_prefix_caching:
            return False
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: {len(token_ids)} != {self.block_size}")
        if self._ref_cnt[block_id] == 0:
            raise ValueError(f"block {block_id} is not in use")
        current = self._hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already holds hash {current:#x}")
            return False
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash
        self._record_stored(block_hash, parent_hash, token_ids)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is referenced (its hash is live)."""
        if self._num_used > 0:
            return False
        for block_id in self._evictable:
            self._hash[block_id] = None
            self._free[block_id] = None
        self._evictable.clear()
        self._cached.clear()
        if self.enable_prefix_caching:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Drain the events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hash[block_id]
        assert block_hash is not None  # only hashed blocks enter the evictable queue
        if self.on_evict is not None:
            self.on_evict(block_id, block_hash)
        del self._cached[block_hash]
        self._hash[block_id] = None
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))
        return block_id

    def _record_stored(
        self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> None:
        # Extend the pending event when this block continues its chain: one event per run of blocks.
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self._events.append(
                BlockStored([block_hash], parent_hash, list(token_ids), self.block_size)
            )
