"""KVCacheManager: block tables, prefix hits across sequences, incremental caching, events."""

from __future__ import annotations

import random

import pytest

from common.block_hash import block_hashes
from engine.block_pool import BlockPool, BlockRemoved, BlockStored
from engine.kv_cache_manager import KVCacheManager, KVCacheStats

BS = 4


def prompt(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def run_prefill(
    mgr: KVCacheManager, seq_id: str, tokens: list[int], extra: tuple[str, ...] = ()
) -> tuple[list[int], int]:
    """What the scheduler does for a new prompt: look up, allocate, run the model, cache."""
    hits, num_cached = mgr.get_computed_blocks(tokens, extra)
    assert mgr.allocate_slots(seq_id, len(tokens), hits)
    mgr.cache_blocks(seq_id, tokens, len(tokens), extra)
    return hits, num_cached


def assert_partition(mgr: KVCacheManager) -> None:
    pool = mgr.pool
    stats = mgr.usage
    assert stats.free + stats.cached + stats.used == stats.total == pool.num_blocks
    in_use = sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) > 0)
    assert stats.used == in_use
    assert mgr.num_free_blocks == pool.num_blocks - in_use


def test_allocate_slots_builds_block_table() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    assert mgr.allocate_slots("a", 10)
    assert mgr.block_table("a") == [0, 1, 2]
    assert mgr.allocate_slots("a", 12)  # still fits in three blocks
    assert mgr.block_table("a") == [0, 1, 2]
    assert mgr.allocate_slots("a", 13)
    assert mgr.block_table("a") == [0, 1, 2, 3]
    assert mgr.usage == KVCacheStats(total=10, free=6, cached=0, used=4)


def test_block_table_is_a_copy() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    mgr.allocate_slots("a", 4)
    mgr.block_table("a").append(3)
    assert mgr.block_table("a") == [0]


def test_allocation_failure_leaves_no_trace() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    assert mgr.allocate_slots("a", 8)
    assert not mgr.allocate_slots("b", 9)  # needs 3, 2 free
    assert not mgr.allocate_slots("a", 17)  # needs 3 more
    assert mgr.block_table("a") == [0, 1]
    with pytest.raises(KeyError):
        mgr.block_table("b")
    assert mgr.num_free_blocks == 2
    assert_partition(mgr)


def test_prefix_hit_across_sequences() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(10)
    assert run_prefill(mgr, "a", tokens) == ([], 0)
    assert mgr.block_table("a") == [0, 1, 2]
    other = tokens[:8] + [99, 98, 97]
    hits, num_cached = mgr.get_computed_blocks(other)
    assert (hits, num_cached) == ([0, 1], 8)
    assert mgr.allocate_slots("b", len(other), hits)
    assert mgr.block_table("b") == [0, 1, 3]
    assert [mgr.pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert_partition(mgr)


def test_hit_on_freed_sequence_revives_cached_blocks() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = prompt(9)
    run_prefill(mgr, "a", tokens)
    mgr.free("a")
    assert mgr.usage == KVCacheStats(total=4, free=2, cached=2, used=0)
    hits, num_cached = run_prefill(mgr, "b", tokens)
    assert (hits, num_cached) == ([0, 1], 8)
    assert mgr.block_table("b") == [0, 1, 3]
    assert_partition(mgr)


def test_full_prompt_hit_leaves_last_token_to_compute() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(8)
    run_prefill(mgr, "a", tokens)
    assert mgr.get_computed_blocks(tokens) == ([0], 4)  # both blocks cached, only one reused
    assert mgr.get_computed_blocks(tokens + [1]) == ([0, 1], 8)
    assert mgr.get_computed_blocks(tokens[:4]) == ([], 0)
    assert mgr.get_computed_blocks([]) == ([], 0)


def test_partial_last_block_is_never_hashed() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(7)
    run_prefill(mgr, "a", tokens)
    (event,) = mgr.take_events()
    assert event == BlockStored(block_hashes(tokens, BS), None, tokens[:4], BS)
    assert mgr.pool.block_hash(mgr.block_table("a")[1]) is None


def test_revival_is_counted_against_free_blocks() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = prompt(9)
    run_prefill(mgr, "a", tokens)
    mgr.free("a")  # blocks 0, 1 cached-free; 2, 3 plain free: 4 "free"
    hits, _ = mgr.get_computed_blocks(tokens)
    assert hits == [0, 1]
    # 2 hits + 3 new would need 5 of the 4 free blocks once the hits leave the free queue.
    assert not mgr.allocate_slots("b", 18, hits)
    assert mgr.usage == KVCacheStats(total=4, free=2, cached=2, used=0)
    assert mgr.allocate_slots("b", 16, hits)
    assert mgr.block_table("b") == [0, 1, 3, 2]  # never-used block 3 was ahead of freed block 2
    assert_partition(mgr)


def test_computed_blocks_only_on_first_allocation() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    run_prefill(mgr, "a", prompt(9))
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", 12, [0])


def test_evicted_computed_block_is_rejected_without_side_effects() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    tokens = prompt(9)
    run_prefill(mgr, "a", tokens)
    mgr.free("a")
    hits, _ = mgr.get_computed_blocks(tokens)
    assert mgr.allocate_slots("x", 12)  # evicts the cached blocks behind the scheduler's back
    with pytest.raises(ValueError):
        mgr.allocate_slots("b", 9, hits)
    assert mgr.usage.used == 3
    assert_partition(mgr)


def test_decode_caches_blocks_incrementally() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(6)
    run_prefill(mgr, "a", tokens)
    mgr.take_events()
    emitted: list[int] = []
    for step in range(7):  # each step: one new token, its KV written next step
        tokens.append(1000 + step)
        assert mgr.allocate_slots("a", len(tokens))
        mgr.cache_blocks("a", tokens, len(tokens) - 1)
        for event in mgr.take_events():
            assert isinstance(event, BlockStored)
            emitted += event.block_hashes
    expected = block_hashes(tokens[: len(tokens) - 1], BS)
    assert emitted == expected[1:]  # block 0 was stored by the prefill
    assert [mgr.pool.block_hash(b) for b in mgr.block_table("a")[:3]] == expected


def test_stored_event_chains_to_parent_of_first_new_block() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(13)
    assert mgr.allocate_slots("a", 13)
    mgr.cache_blocks("a", tokens, 5)
    mgr.cache_blocks("a", tokens, 5)  # nothing new: no event
    h = block_hashes(tokens, BS)
    assert mgr.take_events() == [BlockStored([h[0]], None, tokens[:4], BS)]
    mgr.cache_blocks("a", tokens, 13)
    assert mgr.take_events() == [BlockStored(h[1:], h[0], tokens[4:12], BS)]


def test_cache_salt_isolates_prefix_hits() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(9)
    run_prefill(mgr, "a", tokens, ("salt-a",))
    assert mgr.get_computed_blocks(tokens) == ([], 0)
    assert mgr.get_computed_blocks(tokens, ("salt-b",)) == ([], 0)
    assert mgr.get_computed_blocks(tokens, ("salt-a",)) == ([0, 1], 8)


def test_parallel_samples_share_the_prompt_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(9)
    run_prefill(mgr, "req-0", tokens)
    for i in (1, 2):
        hits, _ = run_prefill(mgr, f"req-{i}", tokens)
        assert hits == [0, 1]
    assert [mgr.pool.ref_count(b) for b in (0, 1)] == [3, 3]
    assert mgr.usage.used == 2 + 3  # shared head + one private tail block each


def test_duplicate_block_from_concurrent_prefill_is_not_stored_twice() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = prompt(9)
    assert mgr.allocate_slots("a", 9)
    assert mgr.allocate_slots("b", 9)  # scheduled before "a" cached anything: no hits
    mgr.cache_blocks("a", tokens, 9)
    mgr.cache_blocks("b", tokens, 9)
    assert len(mgr.take_events()) == 1
    mgr.free("b")
    assert mgr.usage.cached == 0  # b's copies went back as plain free blocks
    assert mgr.get_computed_blocks(tokens) == ([0, 1], 8)


def test_free_is_idempotent_and_releases_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    run_prefill(mgr, "a", prompt(12))
    mgr.take_events()
    mgr.free("a")
    mgr.free("a")
    mgr.free("never-seen")
    assert mgr.allocate_slots("b", 4)
    assert mgr.block_table("b") == [2]  # the tail block is evicted first
    assert mgr.take_events() == [BlockRemoved(block_hashes(prompt(12), BS)[2:])]


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    tokens = prompt(9)
    run_prefill(mgr, "a", tokens)
    mgr.free("a")
    assert mgr.get_computed_blocks(tokens) == ([], 0)
    assert mgr.take_events() == []
    assert mgr.usage == KVCacheStats(total=4, free=4, cached=0, used=0)


def test_reset_prefix_cache_through_manager() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    run_prefill(mgr, "a", prompt(9))
    assert not mgr.reset_prefix_cache()
    mgr.free("a")
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(prompt(9)) == ([], 0)


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_pool_consistent(seed: int) -> None:
    rng = random.Random(seed)
    mgr = KVCacheManager(num_blocks=24, block_size=BS)
    prefixes = [prompt(rng.randint(1, 20), offset=1000 * k) for k in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.3 and len(live) < 12:
            seq_id = f"s{step}"
            tokens = rng.choice(prefixes)[:] + [
                rng.randint(0, 50) for _ in range(rng.randint(0, 9))
            ]
            if not tokens:
                continue
            hits, num_cached = mgr.get_computed_blocks(tokens)
            assert num_cached < len(tokens)
            if mgr.allocate_slots(seq_id, len(tokens), hits):
                assert mgr.block_table(seq_id)[: len(hits)] == hits
                live[seq_id] = tokens
            else:
                with pytest.raises(KeyError):
                    mgr.block_table(seq_id)
        elif op < 0.8 and live:
            seq_id = rng.choice(sorted(live))
            tokens = live[seq_id]
            tokens.append(rng.randint(0, 50))
            if mgr.allocate_slots(seq_id, len(tokens)):
                mgr.cache_blocks(seq_id, tokens, rng.randint(len(tokens) - 2, len(tokens)))
            else:
                mgr.free(seq_id)  # preempted
                del live[seq_id]
        elif live:
            seq_id = rng.choice(sorted(live))
            mgr.free(seq_id)
            del live[seq_id]
        assert_partition(mgr)
        check_pool_hash_map(mgr.pool)
        for seq_id, tokens in live.items():
            assert len(mgr.block_table(seq_id)) * BS >= len(tokens)
        mgr.take_events()
    for seq_id in list(live):
        mgr.free(seq_id)
    assert mgr.usage.used == 0
    assert mgr.num_free_blocks == mgr.pool.num_blocks
    assert all(mgr.pool.ref_count(b) == 0 for b in range(mgr.pool.num_blocks))


def check_pool_hash_map(pool: BlockPool) -> None:
    for b in range(pool.num_blocks):
        h = pool.block_hash(b)
        if h is not None:
            assert pool.get_cached_block(h) == b
