"""BlockPool: ref counts, LRU eviction order, hash map and KV events, with exact block ids."""

from __future__ import annotations

import pytest

from engine.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    NoFreeBlocksError,
)

BS = 4


def toks(block: int) -> list[int]:
    """Distinct tokens for a made-up block number."""
    return [block * 100 + i for i in range(BS)]


def check_invariants(pool: BlockPool) -> None:
    in_use = sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) > 0)
    cached_free = sum(
        1
        for b in range(pool.num_blocks)
        if pool.ref_count(b) == 0 and pool.block_hash(b) is not None
    )
    plain_free = sum(
        1 for b in range(pool.num_blocks) if pool.ref_count(b) == 0 and pool.block_hash(b) is None
    )
    assert plain_free + cached_free + in_use == pool.num_blocks
    assert pool.num_used_blocks == in_use
    assert pool.num_cached_blocks == cached_free
    assert pool.num_free_blocks == pool.num_blocks - in_use
    for b in range(pool.num_blocks):
        h = pool.block_hash(b)
        if h is not None:
            assert pool.get_cached_block(h) == b


def test_fresh_pool_hands_out_blocks_in_order() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert [pool.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 5
    check_invariants(pool)


def test_allocate_zero_is_empty() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_allocation_failure_leaves_no_trace() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = pool.allocate(2)
    pool.cache_block(a[0], 11, None, toks(0))
    pool.free(a)  # block 0 cached-free, block 1 plain free
    pool.take_events()
    pool.allocate(1)  # takes plain free block 2
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(11) == 0  # not evicted by the failed call
    assert pool.take_events() == []
    check_invariants(pool)


def test_free_returns_blocks_and_double_free_is_rejected() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free([blocks[0]])


def test_unhashed_free_blocks_go_before_any_cached_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = pool.allocate(2)  # [0, 1]
    pool.cache_block(0, 10, None, toks(0))
    pool.cache_block(1, 11, 10, toks(1))
    pool.free(a)
    # Blocks 2 and 3 were never hashed: they are handed out first, cache intact.
    assert pool.allocate(2) == [2, 3]
    assert pool.get_cached_block(10) == 0
    assert pool.get_cached_block(11) == 1
    check_invariants(pool)


def test_sequence_tail_is_evicted_before_its_head() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    seq = pool.allocate(3)  # [0, 1, 2]
    parent = None
    for i, b in enumerate(seq):
        pool.cache_block(b, 100 + i, parent, toks(i))
        parent = 100 + i
    pool.free(seq)  # tail first: LRU queue is 2, 1, 0
    pool.take_events()
    assert pool.allocate(1) == [2]
    assert pool.take_events() == [BlockRemoved([102])]
    assert pool.allocate(1) == [1]
    assert pool.get_cached_block(100) == 0  # head still cached
    assert pool.get_cached_block(101) is None
    check_invariants(pool)


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1, None, toks(1))
    pool.cache_block(b, 2, None, toks(2))
    pool.free([b])
    pool.free([a])
    assert pool.allocate(1) == [b]
    assert pool.allocate(1) == [a]
    assert pool.take_events()[-1] == BlockRemoved([2, 1])  # consecutive removals are batched


def test_touch_revives_cached_block_and_protects_it_from_eviction() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    a = pool.allocate(2)
    pool.cache_block(a[0], 10, None, toks(0))
    pool.cache_block(a[1], 11, 10, toks(1))
    pool.free(a)
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(10)
    assert hit == 0
    pool.touch([hit])
    assert pool.ref_count(0) == 1
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [2, 1]  # plain free block 2, then evicts block 1; block 0 is held
    assert pool.get_cached_block(10) == 0
    check_invariants(pool)


def test_touch_in_use_block_adds_a_ref() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5, None, toks(0))
    pool.touch([a])
    assert pool.ref_count(a) == 2
    pool.free([a])
    assert pool.ref_count(a) == 1
    assert pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_cached_blocks == 1
    check_invariants(pool)


def test_cache_block_emits_batched_stored_events() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = pool.allocate(3)
    assert pool.cache_block(a[0], 10, None, toks(0))
    assert pool.cache_block(a[1], 11, 10, toks(1))
    assert pool.cache_block(a[2], 99, 55, toks(2))  # a different chain: a new event
    assert pool.take_events() == [
        BlockStored([10, 11], None, toks(0) + toks(1), BS),
        BlockStored([99], 55, toks(2), BS),
    ]
    assert pool.take_events() == []


def test_duplicate_hash_keeps_existing_mapping_without_event() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 10, None, toks(0))
    pool.take_events()
    assert not pool.cache_block(b, 10, None, toks(0))
    assert pool.get_cached_block(10) == a
    assert pool.block_hash(b) is None
    assert pool.take_events() == []
    pool.free([b])  # unhashed duplicate goes back as a plain free block
    assert pool.num_cached_blocks == 0
    check_invariants(pool)


def test_cache_block_is_idempotent_and_rejects_misuse() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    (a,) = pool.allocate(1)
    assert pool.cache_block(a, 10, None, toks(0))
    assert not pool.cache_block(a, 10, None, toks(0))
    with pytest.raises(ValueError):
        pool.cache_block(a, 12, None, toks(0))  # a block holds one hash
    with pytest.raises(ValueError):
        pool.cache_block(a, 10, None, toks(0)[:-1])  # partial blocks are never cached
    with pytest.raises(ValueError):
        pool.cache_block(3, 13, None, toks(0))  # not in use


def test_evicted_hash_can_be_cached_again_on_another_block() -> None:
    pool = BlockPool(num_blocks=1, block_size=BS)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 10, None, toks(0))
    pool.free([a])
    (b,) = pool.allocate(1)  # evicts hash 10
    assert pool.get_cached_block(10) is None
    assert pool.cache_block(b, 10, None, toks(0))
    assert pool.take_events() == [
        BlockStored([10], None, toks(0), BS),
        BlockRemoved([10]),
        BlockStored([10], None, toks(0), BS),
    ]


def test_reset_prefix_cache_only_when_nothing_is_referenced() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = pool.allocate(2)
    pool.cache_block(a[0], 10, None, toks(0))
    pool.take_events()
    assert not pool.reset_prefix_cache()
    assert pool.take_events() == []
    pool.free(a)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(10) is None
    assert pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 4
    check_invariants(pool)


def test_prefix_caching_disabled_never_caches_or_emits() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, 10, None, toks(0))
    assert pool.get_cached_block(10) is None
    pool.free([a])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == []


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks=0, block_size=BS)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=0)
