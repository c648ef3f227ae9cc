"""Per-sequence block tables on top of the BlockPool, as the scheduler sees them.

The scheduler asks three things: how much of a new prompt is already cached (`get_computed_blocks`),
whether a step's tokens fit (`allocate_slots`, False means "preempt someone"), and, after the model
wrote KV, to publish the newly full blocks (`cache_blocks`). Parallel samples (n > 1) and repeated
prompts share blocks through the prefix cache; beams fork (`fork`: full blocks shared, the
partial last one copied).

Block table of one sequence (block_size 4, 10 tokens, KV written for 9):

    block_table  [ 7 ][ 3 ][ 12 ]
    tokens        0-3  4-7  8-9      block 12 is partial: never hashed
    hashes        h0   h1            h1 = H(h0, tokens 4-7, extra_keys)
    head: prefix hits shared with other sequences (touch); tail: allocated for this sequence
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.block_hash import ExtraKey, block_hashes, hash_block
from engine.block_pool import BlockPool, KVEvent

if TYPE_CHECKING:
    from engine.kv_offload import KVOffload


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    """A partition of the pool: free + cached + used == total."""

    total: int
    free: int  # no hash, unreferenced
    cached: int  # hashed, unreferenced: evictable prefix-cache entries
    used: int  # referenced by at least one sequence


@dataclass(slots=True)
class _SeqBlocks:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of block_ids[:len(block_hashes)]


class KVCacheManager:
    """Block tables keyed by sequence id, with prefix caching through the shared pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        offload: KVOffload | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._seqs: dict[str, _SeqBlocks] = {}
        # evicted cached blocks are copied out to it, and prefix misses it holds copied back in
        self.offload = offload if enable_prefix_caching else None
        if self.offload is not None:
            self.pool.on_evict = self.offload.offload

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> KVCacheStats:
        pool = self.pool
        return KVCacheStats(
            total=pool.num_blocks,
            free=pool.num_free_blocks - pool.num_cached_blocks,
            cached=pool.num_cached_blocks,
            used=pool.num_used_blocks,
        )

    def get_computed_blocks(
        self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...] = ()
    ) -> tuple[list[int], int]:
        """Cached blocks matching the prompt's longest prefix, and how many tokens they cover.

        At least one prompt token is always left uncovered: the last one must run through the model
        to produce logits. Takes no refs, so call allocate_slots right after, before anything else
        allocates.
        """
        if not self.pool.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            block = token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = hash_block(parent, block, extra_keys)
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                if self.offload is not None and block_hash in self.offload:
                    hits += self._restore(token_ids, extra_keys, hits, i, parent, max_blocks)
                break
            hits.append(block_id)
            parent = block_hash
        return hits, len(hits) * self.block_size

    def _restore(
        self,
        token_ids: Sequence[int],
        extra_keys: tuple[ExtraKey, ...],
        hits: list[int],
        start: int,
        parent: int | None,
        max_blocks: int,
    ) -> list[int]:
        """Continue the prefix from block `start` with the offload tier: each block it holds is
        copied into a fresh pool block and cached there, as if it had never left. Returns those
        blocks (and pool hits met on the way), cached-free like any prefix hit.

        The pool hits are pinned meanwhile: allocating a restore target may evict cached-free
        blocks, and must not evict this prompt's own head.
        """
        assert self.offload is not None
        pool, size = self.pool, self.block_size
        pool.touch(hits)
        found: list[int] = []
        try:
            for i in range(start, max_blocks):
                block = token_ids[i * size : (i + 1) * size]
                block_hash = hash_block(parent, block, extra_keys)
                block_id = pool.get_cached_block(block_hash)
                if block_id is not None:
                    pool.touch([block_id])
                elif block_hash in self.offload and pool.num_free_blocks > 0:
                    [block_id] = pool.allocate(1)
                    if not self.offload.restore(block_hash, block_id):
                        pool.free([block_id])  # no hash: back to the plain free queue
                        break
                    pool.cache_block(block_id, block_hash, parent, block)
                else:
                    break
                found.append(block_id)
                parent = block_hash
        finally:
            pool.free(hits + found)  # head first; leaves them cached-free, most recently used
        return found

    def allocate_slots(
        self, seq_id: str, num_total_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow `seq_id`'s block table to hold `num_total_tokens` tokens.

        On the first call, `computed_blocks` (from get_computed_blocks) become the table's head.
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        seq = self._seqs.get(seq_id)
        if seq is not None and computed_blocks:
            raise ValueError(
                f"{seq_id}: computed_blocks only apply to a sequence's first allocation"
            )
        if any(self.pool.block_hash(b) is None for b in computed_blocks):
            raise ValueError(f"{seq_id}: a computed block was evicted before allocate_slots")
        num_held = len(seq.block_ids) if seq is not None else len(computed_blocks)
        num_new = max(0, -(-num_total_tokens // self.block_size) - num_held)
        # Cached-free hits leave the free queue when touched, so they compete with the new blocks.
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if num_new + num_revived > self.pool.num_free_blocks:
            return False
        if seq is None:
            self.pool.touch(computed_blocks)
            hashes = [self.pool.block_hash(b) for b in computed_blocks]
            seq = _SeqBlocks(list(computed_blocks), [h for h in hashes if h is not None])
            self._seqs[seq_id] = seq
        seq.block_ids.extend(self.pool.allocate(num_new))
        return True

    def cache_blocks(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> None:
        """Hash and register the blocks made full by the first `num_computed_tokens` tokens' KV.

        Incremental: blocks hashed by an earlier call (or reused as prefix hits) are not rehashed.
        """
        if not self.pool.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        num_full = min(num_full, len(seq.block_ids))
        num_known = len(seq.block_hashes)
        if num_full <= num_known:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        new_hashes = block_hashes(
            token_ids[: num_full * self.block_size],
            self.block_size,
            extra_keys,
            start=num_known,
            parent=parent,
        )
        for i, block_hash in enumerate(new_hashes, start=num_known):
            block = token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.pool.cache_block(seq.block_ids[i], block_hash, parent, block)
            seq.block_hashes.append(block_hash)
            parent = block_hash

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """A beam's child: it shares the parent's full blocks of its first `num_tokens` tokens
        (a ref each) and gets its own copy of the partial last one, which it will write into.
        Returns (parent's block, child's block) for the caller to copy the KV, or None when the
        blocks are shared whole; raises NoFreeBlocksError (changing nothing) when no block is
        free for the copy."""
        parent = self._seqs[parent_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        shared = parent.block_ids[:num_full]
        copy = self.pool.allocate(1) if partial else []
        self.pool.touch(shared)
        self._seqs[child_id] = _SeqBlocks(shared + copy, parent.block_hashes[:num_full])
        return (parent.block_ids[num_full], copy[0]) if copy else None

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens: the slots a speculative step wrote
        for proposals it rejected. Those blocks were never hashed (cache_blocks registers only
        blocks full of computed tokens, and rejected ones are never counted computed).

            before  [ 7 ][ 3 ][ 12 ][ 9 ]    num_tokens 9, block_size 4
            after   [ 7 ][ 3 ][ 12 ]         block 9 (rejected slots only) back to the free queue
        """
        seq = self._seqs[seq_id]
        keep = -(-num_tokens // self.block_size)
        tail = seq.block_ids[keep:]
        if tail:
            assert len(seq.block_hashes) <= keep, "a hashed block past the kept tokens"
            del seq.block_ids[keep:]
            self.pool.free(tail)

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks (tail first, see BlockPool.free); ignores unknown ids."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free(seq.block_ids)

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block ids, head first."""
        return list(self._seqs[seq_id].block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.offload is not None:  # AllBlocksCleared drops the tiers' hashes too
            self.offload.clear()
        return True

    def take_events(self) -> list[KVEvent]:
        events = self.pool.take_events()
        if self.offload is not None:
            events += self.offload.take_events()
        return events
