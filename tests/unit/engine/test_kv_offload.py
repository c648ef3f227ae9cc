"""The KV offload tier (engine/kv_offload.py, engine/kv_disk_tier.py) on a real pool tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.block_hash import block_hashes
from common.config import KVOffloadConfig
from common.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, BlockRemoved, BlockStored
from engine.kv_cache_manager import KVCacheManager
from engine.kv_disk_tier import DiskTier
from engine.kv_offload import KVOffload

BLOCK_SIZE = 2
BLOCK_SHAPE = (3, 2, BLOCK_SIZE, 2, 4)  # layers, K/V, tokens, kv heads, head_dim


def _pool(num_blocks: int) -> torch.Tensor:
    # (num_blocks, *BLOCK_SHAPE), every block distinct
    return torch.randn((num_blocks, *BLOCK_SHAPE))


def _block_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def _medium_hashes(events: list, kind: type, medium: str) -> list[int]:
    return [h for e in events if type(e) is kind and e.medium == medium for h in e.block_hashes]


def test_host_tier_keeps_the_most_recent_blocks_within_its_bytes() -> None:
    pool = _pool(8)
    offload = KVOffload(pool, KVOffloadConfig(host_bytes=3 * _block_bytes(pool) + 5))
    for block_id, block_hash in enumerate([10, 11, 12]):
        offload.offload(block_id, block_hash)
    assert offload.host.slot(10) is not None  # 10 becomes most recently used; 11 is now oldest
    offload.offload(3, 13)
    assert sorted(offload.host.hashes()) == [10, 12, 13]
    assert 11 not in offload
    events = offload.take_events()
    assert _medium_hashes(events, BlockStored, MEDIUM_CPU) == [10, 11, 12, 13]
    assert _medium_hashes(events, BlockRemoved, MEDIUM_CPU) == [11]
    assert offload.take_events() == []


def test_restore_copies_the_block_kept_under_its_hash() -> None:
    pool = _pool(4)
    original = pool[1].clone()
    offload = KVOffload(pool, KVOffloadConfig(host_bytes=2 * _block_bytes(pool)))
    offload.offload(1, 0xABC)
    pool[1].zero_()  # the pool reuses the block
    assert offload.restore(0xABC, 3)
    assert torch.equal(pool[3], original)
    assert not offload.restore(0xABD, 2)  # another hash: nothing
    offload.offload(1, 0xABC)  # evicted again, already held: not copied twice
    assert offload.num_offloaded_blocks == 1 and offload.num_restored_blocks == 1


def test_host_tier_refuses_a_budget_below_one_block() -> None:
    pool = _pool(2)
    with pytest.raises(ValueError, match="holds no"):
        KVOffload(pool, KVOffloadConfig(host_bytes=_block_bytes(pool) - 1))


def test_disk_tier_round_trip_lru_bound_and_cleanup(tmp_path: Path) -> None:
    pool = _pool(6)
    originals = pool.clone()
    nbytes = _block_bytes(pool)
    config = KVOffloadConfig(host_bytes=nbytes, disk_path=str(tmp_path), disk_bytes=2 * nbytes)
    offload = KVOffload(pool, config)
    assert offload.disk is not None
    for block_id in range(4):  # host keeps the last; disk the two before it; block 0 falls off
        offload.offload(block_id, 100 + block_id)
    assert offload.host.hashes() == [103]
    assert offload.disk.hashes() == [101, 102]
    assert 100 not in offload
    events = offload.take_events()
    assert _medium_hashes(events, BlockStored, MEDIUM_DISK) == [100, 101, 102]
    assert _medium_hashes(events, BlockRemoved, MEDIUM_DISK) == [100]
    offload.disk.flush()
    files = sorted(p.name for p in offload.disk.directory.iterdir())
    assert files == [f"{h:016x}.kv" for h in (101, 102)]
    pool.zero_()
    assert offload.restore(101, 5) and offload.restore(103, 4)
    assert torch.equal(pool[5], originals[1]) and torch.equal(pool[4], originals[3])
    directory = offload.disk.directory
    offload.close()
    assert not directory.exists()


def test_disk_tier_serves_a_block_before_its_file_is_written(tmp_path: Path) -> None:
    pool = _pool(2)
    disk = DiskTier(str(tmp_path), 4 * _block_bytes(pool), _block_bytes(pool))
    try:
        assert disk.put(7, pool[0]) == []
        out = torch.empty_like(pool[1])
        assert disk.read_into(7, out)  # from the writer's queue or the file, whichever
        assert torch.equal(out, pool[0])
        disk.remove(7)
        disk.flush()
        assert list(disk.directory.iterdir()) == []
        assert not disk.read_into(7, out)
    finally:
        disk.close()


def test_disk_tier_reads_a_file_through_its_staging_buffer(tmp_path: Path) -> None:
    """pin=True (a GPU pool: the buffer is pinned there) reads each file into one reused host
    buffer, then into the pool block: the same bytes as numpy's read, file after file."""
    pool = _pool(3)
    disk = DiskTier(str(tmp_path), 4 * _block_bytes(pool), _block_bytes(pool), pin=True)
    try:
        assert disk.put(7, pool[0]) == [] and disk.put(8, pool[1]) == []
        disk.flush()  # both on disk: read_into reads the files
        out = torch.empty_like(pool[2])
        for block_hash, block in ((7, pool[0]), (8, pool[1]), (7, pool[0])):
            assert disk.read_into(block_hash, out) and torch.equal(out, block)
        disk._file(8).write_bytes(b"short")
        assert not disk.read_into(8, out) and 8 not in disk  # unreadable: forgotten
    finally:
        disk.close()


def _manager(num_blocks: int, host_blocks: int) -> tuple[KVCacheManager, torch.Tensor]:
    pool = _pool(num_blocks)
    offload = KVOffload(pool, KVOffloadConfig(host_bytes=host_blocks * _block_bytes(pool)))
    return KVCacheManager(num_blocks, BLOCK_SIZE, offload=offload), pool


def _prefill(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> list[int]:
    blocks, num_cached = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(seq_id, len(tokens), blocks)
    kv.cache_blocks(seq_id, tokens, len(tokens))
    return kv.block_table(seq_id)


def test_evicted_prefix_comes_back_from_the_tier_with_its_kv() -> None:
    kv, pool = _manager(num_blocks=4, host_blocks=8)
    prompt_a = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks + 1 token
    table_a = _prefill(kv, "a", prompt_a)
    kv_a = pool[table_a[:3]].clone()
    kv.free("a")
    _prefill(kv, "b", [9, 9, 8, 8, 7, 7, 6, 6])  # evicts all of a's blocks into the tier
    kv.free("b")
    assert kv.pool.get_cached_block(block_hashes(prompt_a, BLOCK_SIZE)[0]) is None
    kv.take_events()

    blocks, num_cached = kv.get_computed_blocks(prompt_a)
    assert num_cached == 6  # three blocks, restored rather than recomputed
    assert torch.equal(pool[blocks], kv_a)
    assert all(kv.pool.ref_count(b) == 0 for b in blocks)  # cached-free, like any prefix hit
    events = kv.take_events()
    hashes_a = block_hashes(prompt_a, BLOCK_SIZE)
    assert _medium_hashes(events, BlockStored, MEDIUM_GPU) == hashes_a
    assert kv.allocate_slots("a2", len(prompt_a), blocks)
    kv.free("a2")
    usage = kv.usage
    assert usage.used == 0 and usage.free + usage.cached == usage.total


def test_restore_stops_where_the_pool_has_no_free_block() -> None:
    kv, _ = _manager(num_blocks=4, host_blocks=8)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    _prefill(kv, "a", prompt)
    kv.free("a")
    _prefill(kv, "b", [9, 9, 8, 8, 7, 7, 6, 6])  # a's three blocks go to the tier
    blocks, num_cached = kv.get_computed_blocks(prompt)  # b holds all 4 blocks
    assert (blocks, num_cached) == ([], 0)
    kv.free("b")
    assert kv.usage.used == 0


def test_restore_keeps_the_prompts_own_pool_hits() -> None:
    """Allocating restore targets evicts cached-free blocks, never the prompt's own head."""
    kv, pool = _manager(num_blocks=4, host_blocks=8)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    table = _prefill(kv, "a", prompt)
    expected = pool[table[:3]].clone()
    kv.free("a")  # tail first: the partial block plain free, then cached a2 oldest, a1, a0
    _prefill(kv, "b", [9, 9, 8, 8])  # the plain free block, then a2's evicted
    kv.free("b")  # LRU now: a1, a0, b's two; a restore target would evict a1 unless pinned
    blocks, num_cached = kv.get_computed_blocks(prompt)
    assert num_cached == 6
    assert torch.equal(pool[blocks], expected)


def test_reset_prefix_cache_empties_the_tier() -> None:
    kv, _ = _manager(num_blocks=3, host_blocks=4)
    _prefill(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    _prefill(kv, "b", [6, 7, 8, 9, 10])
    kv.free("b")
    assert kv.offload is not None and len(kv.offload.host) == 2
    assert kv.reset_prefix_cache()
    assert len(kv.offload.host) == 0
    assert kv.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_pool_offloads_to_pinned_host_memory_and_disk(tmp_path: Path) -> None:
    pool = _pool(4).cuda()
    originals = pool.clone()
    nbytes = _block_bytes(pool)
    config = KVOffloadConfig(host_bytes=nbytes, disk_path=str(tmp_path), disk_bytes=2 * nbytes)
    offload = KVOffload(pool, config)
    assert offload.host.slots.is_pinned()
    offload.offload(0, 1)
    offload.offload(1, 2)  # block 0's copy moves on to the disk tier
    pool.zero_()
    assert offload.restore(1, 2) and offload.restore(2, 3)
    assert offload.num_disk_restored_blocks == 1
    assert torch.equal(pool[2], originals[0]) and torch.equal(pool[3], originals[1])
    offload.close()
