"""Reading a peer's host offload tier over real NIXL/UCX (engine/kv_tier_share.py): in one
process, from another process, and from one killed meanwhile (the reader gets nothing back and
every slot it reserved is free again)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import msgspec
import pytest
import torch

from common.config import KVOffloadConfig
from common.protocol import KVPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_offload import KVOffload
from engine.kv_tier_share import TierShare
from engine.kv_transfer import KVTransferAgent
from tests.unit.engine.test_kv_transfer import TIMEOUT_S, spawned

NUM_BLOCKS = 16
BLOCK_SHAPE = (2, 2, 4, 2, 8)  # (num_layers, K/V, block_size, num_kv_heads, head_dim)
HOST_SLOTS = 8
HASHES = [0x1111, 0x2222, 0x3333, (1 << 64) - 5]  # the last above 2**63: stored as int64


def make_pool(seed: int | None) -> torch.Tensor:
    # (num_blocks, *BLOCK_SHAPE)
    if seed is None:
        return torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE)
    return torch.randn(NUM_BLOCKS, *BLOCK_SHAPE, generator=torch.Generator().manual_seed(seed))


def worker_side(name: str, seed: int | None) -> tuple[KVTransferAgent, KVOffload, TierShare]:
    pool = make_pool(seed)
    block_bytes = pool[0].numel() * pool.element_size()
    offload = KVOffload(pool, KVOffloadConfig(host_bytes=HOST_SLOTS * block_bytes))
    agent = KVTransferAgent(name, pool, block_bytes)
    return agent, offload, TierShare(agent, offload, timeout_s=3.0)


@pytest.fixture
def pair() -> Iterator[tuple[tuple, tuple]]:
    source, reader = worker_side("ctx-src", seed=3), worker_side("ctx-rdr", seed=None)
    yield source, reader
    for agent, offload, share in (reader, source):
        share.close()
        agent.close()
        offload.close()


def test_a_peer_tier_is_read_into_the_readers_tier_and_restored_from_there(pair) -> None:
    (src_agent, src_offload, _), (rdr_agent, rdr_offload, rdr_share) = pair
    for block_id, block_hash in enumerate(HASHES[:3]):
        src_offload.offload(block_id, block_hash)  # the source's pool evicted blocks 0-2
    rdr_share.sync_peers([src_agent.info(), rdr_agent.info()])  # itself is skipped
    assert rdr_share.peer_names == ["ctx-src"]
    assert rdr_share.fetch("ctx-src", HASHES) == 3  # the run stops at the one it lacks
    assert sorted(rdr_offload.host.hashes()) == sorted(HASHES[:3])
    for i, block_hash in enumerate(HASHES[:3]):
        assert rdr_offload.restore(block_hash, 10 + i)
    assert torch.equal(rdr_offload.pool[10:13], src_offload.pool[0:3])
    assert rdr_share.fetch("ctx-src", HASHES[3:]) == 0  # the first wanted block is not there


def test_fetch_prompt_reads_past_what_the_reader_holds(pair) -> None:
    (src_agent, src_offload, _), (_, rdr_offload, rdr_share) = pair
    kv = KVCacheManager(NUM_BLOCKS, block_size=4, offload=rdr_offload)
    prompt = list(range(1, 15))  # 3 full blocks before the last token
    from common.block_hash import block_hashes

    hashes = block_hashes(prompt[:12], 4)
    for block_id, block_hash in enumerate(hashes):
        src_offload.offload(block_id, block_hash)
    rdr_share.sync_peers([src_agent.info()])
    assert rdr_share.fetch_prompt("ctx-src", kv, prompt, ()) == 3
    assert rdr_share.fetch_prompt("ctx-src", kv, prompt, ()) == 0  # now held locally
    blocks, num_cached = kv.get_computed_blocks(prompt)
    assert num_cached == 12
    assert torch.equal(rdr_offload.pool[blocks], src_offload.pool[0:3])


def test_a_restarted_peer_is_prepared_again_and_a_departed_one_forgotten(pair) -> None:
    (src_agent, _, _), (rdr_agent, _, rdr_share) = pair
    rdr_share.sync_peers([src_agent.info()])
    assert rdr_share.peer_names == ["ctx-src"] and rdr_agent.peer_names == ["ctx-src"]
    rdr_share.sync_peers([])
    assert rdr_share.peer_names == [] and rdr_agent.peer_names == []


def serve_tier(conn: Connection, seed: int, timeout_s: float) -> None:
    """A context worker's tier in its own process: blocks 0-2 offloaded under HASHES[:3]."""
    agent, offload, share = worker_side("ctx-proc", seed)
    for block_id, block_hash in enumerate(HASHES[:3]):
        offload.offload(block_id, block_hash)
    conn.send(msgspec.structs.asdict(agent.info()))
    conn.poll(timeout_s)
    share.close()
    agent.close()


@pytest.fixture
def source_process() -> Iterator[tuple[mp.process.BaseProcess, Connection]]:
    with spawned(serve_tier) as source:
        yield source


def peer_info(conn: Connection) -> KVPool:
    assert conn.poll(TIMEOUT_S), "the source process did not answer"
    return msgspec.convert(conn.recv(), KVPool)


def test_reading_a_killed_peers_tier_gives_nothing_and_frees_its_slots(
    source_process: tuple[mp.process.BaseProcess, Connection],
) -> None:
    process, conn = source_process
    agent, offload, share = worker_side("ctx-reader", seed=None)
    try:
        share.sync_peers([peer_info(conn)])
        assert share.fetch("ctx-proc", HASHES[:2]) == 2  # alive: read
        expected = make_pool(7)[0:2]
        assert offload.restore(HASHES[0], 5) and offload.restore(HASHES[1], 6)
        assert torch.equal(offload.pool[5:7], expected)
        process.kill()  # the peer dies while this worker is about to read its tier
        process.join(5)
        held = sorted(offload.host.hashes())
        started = time.monotonic()
        assert share.fetch("ctx-proc", HASHES[2:3]) == 0
        assert time.monotonic() - started < 3.0 + 2.0
        assert sorted(offload.host.hashes()) == held  # nothing adopted
        assert len(offload.host._free) == HOST_SLOTS - len(held)  # every reserved slot back
        assert share.num_failed_reads >= 1
    finally:
        share.close()
        agent.close()


def test_a_slot_the_peer_rewrites_during_the_read_is_not_adopted(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer's loop runs on while a reader copies its slots: a block it evicts from its tier
    meanwhile must not be taken for the one the reader wanted."""
    (src_agent, src_offload, _), (_, rdr_offload, rdr_share) = pair
    for block_id, block_hash in enumerate(HASHES[:2]):
        src_offload.offload(block_id, block_hash)
    rdr_share.sync_peers([src_agent.info()])
    reads = []
    real_read = TierShare._read

    def read_then_peer_moves_on(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        ok = real_read(self, *args, **kwargs)
        reads.append(ok)
        if len(reads) == 2:  # the slots are copied: now the peer fills its tier past full
            for block_id in range(HOST_SLOTS - 1):
                src_offload.offload(2 + block_id, 0x9000 + block_id)  # evicts HASHES[0] first
        return ok

    monkeypatch.setattr(TierShare, "_read", read_then_peer_moves_on)
    assert rdr_share.fetch("ctx-src", HASHES[:2]) == 0  # the run breaks at its first block
    assert reads == [True, True, True]
    assert rdr_offload.host.hashes() == []  # both reserved slots given back
    assert len(rdr_offload.host._free) == HOST_SLOTS
