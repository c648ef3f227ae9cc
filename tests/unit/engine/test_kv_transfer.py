"""KV block READs over real NIXL/UCX on the CPU: in one process, across processes, bad input."""

from __future__ import annotations

import multiprocessing as mp
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import msgspec
import pytest
import torch

from common.protocol import KVPool
from engine.kv_transfer import KVTransferAgent, KVTransferError, TransferHandle

NUM_BLOCKS = 64
BLOCK_SHAPE = (2, 2, 16, 2, 8)  # (num_layers, K/V, block_size, num_kv_heads, head_dim), as KVCache
TIMEOUT_S = 20.0


def make_pool(num_blocks: int, seed: int | None) -> torch.Tensor:
    """A block-major pool like KVCache.pool: zeros, or a seeded pattern any process can rebuild."""
    # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    if seed is None:
        return torch.zeros(num_blocks, *BLOCK_SHAPE, dtype=torch.float16)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, *BLOCK_SHAPE, generator=generator).to(torch.float16)


def block_num_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def wait_done(agent: KVTransferAgent, handle: TransferHandle) -> str:
    while (state := agent.poll(handle)) == "pending":
        time.sleep(0.001)
    return state


def wait_notifications(
    agent: KVTransferAgent, timeout_s: float = TIMEOUT_S
) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if notifications := agent.take_notifications():
            return notifications
        time.sleep(0.005)
    return []


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[KVTransferAgent, KVTransferAgent]]:
    """One process: a context-side agent over a patterned pool, a generation-side one over zeros."""
    source_pool, reader_pool = make_pool(NUM_BLOCKS, seed=1), make_pool(NUM_BLOCKS, seed=None)
    source = KVTransferAgent("ctx-0", source_pool, block_num_bytes(source_pool))
    reader = KVTransferAgent("gen-0", reader_pool, block_num_bytes(reader_pool))
    reader.add_peer(source.info())
    yield source, reader
    reader.close()
    source.close()


def test_read_scattered_blocks_in_one_process_notifies_source(
    pair: tuple[KVTransferAgent, KVTransferAgent],
) -> None:
    source, reader = pair
    reader.pool.zero_()
    remote_ids, local_ids = [13, 2, 7, 63, 31], [0, 5, 6, 20, 3]

    handle = reader.start_read("ctx-0", remote_ids, local_ids, b"chatcmpl-1")
    assert wait_done(reader, handle) == "done", handle.error
    reader.release(handle)

    assert torch.equal(reader.pool[local_ids], source.pool[remote_ids])
    untouched = [i for i in range(NUM_BLOCKS) if i not in local_ids]
    assert not reader.pool[untouched].any()
    assert handle.num_blocks == 5
    assert handle.num_bytes == 5 * reader.block_num_bytes
    assert handle.seconds is not None and 0 < handle.seconds < TIMEOUT_S
    assert wait_notifications(source) == [("gen-0", b"chatcmpl-1")]


def test_info_is_plain_data_that_rides_msgpack(
    pair: tuple[KVTransferAgent, KVTransferAgent],
) -> None:
    info = pair[0].info()
    wire = msgspec.msgpack.encode(msgspec.structs.asdict(info))
    assert KVPool(**msgspec.msgpack.decode(wire)) == info
    assert info.memory_kind == "DRAM" and info.num_blocks == NUM_BLOCKS


def test_bad_block_ids_raise_before_anything_is_posted(
    pair: tuple[KVTransferAgent, KVTransferAgent],
) -> None:
    _, reader = pair
    with pytest.raises(ValueError, match=r"peer 'ctx-0' block ids \[64\] out of range"):
        reader.start_read("ctx-0", [1, 64], [0, 1], b"x")
    with pytest.raises(ValueError, match=r"local block ids \[-1\] out of range"):
        reader.start_read("ctx-0", [1, 2], [0, -1], b"x")
    with pytest.raises(ValueError, match="2 remote block ids but 1 local"):
        reader.start_read("ctx-0", [1, 2], [0], b"x")
    with pytest.raises(ValueError, match="non-empty"):
        reader.start_read("ctx-0", [], [], b"x")
    with pytest.raises(ValueError, match="repeat"):
        reader.start_read("ctx-0", [1, 2], [3, 3], b"x")


def test_unknown_peer_and_mismatched_pool_raise(
    pair: tuple[KVTransferAgent, KVTransferAgent],
) -> None:
    source, reader = pair
    with pytest.raises(KVTransferError, match="unknown peer 'ctx-9'"):
        reader.start_read("ctx-9", [1], [0], b"x")
    other_layout = msgspec.structs.replace(
        source.info(), block_num_bytes=reader.block_num_bytes * 2
    )
    with pytest.raises(KVTransferError, match="block_size differ"):
        reader.add_peer(other_layout)


def test_readding_a_peer_replaces_it(pair: tuple[KVTransferAgent, KVTransferAgent]) -> None:
    source, reader = pair
    reader.add_peer(source.info())  # what a restarted context worker's re-registration does
    handle = reader.start_read("ctx-0", [4], [9], b"again")
    assert wait_done(reader, handle) == "done", handle.error
    reader.release(handle)
    assert torch.equal(reader.pool[9], source.pool[4])
    assert wait_notifications(source) == [("gen-0", b"again")]


def test_idle_agents_do_not_spin_a_core(pair: tuple[KVTransferAgent, KVTransferAgent]) -> None:
    # nixl_agent's default progress thread busy-polls a whole core; ours sleeps on UCX's event fd.
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu_s < 0.3


def test_close_is_idempotent() -> None:
    pool = make_pool(4, seed=None)
    agent = KVTransferAgent("lonely", pool, block_num_bytes(pool))
    agent.close()
    agent.close()


def serve_pool(conn: Connection, seed: int, timeout_s: float) -> None:
    """Child process: own a patterned pool, send its info, report notifications, wait for stop."""
    pool = make_pool(NUM_BLOCKS, seed)
    with KVTransferAgent("ctx-proc", pool, block_num_bytes(pool)) as agent:
        conn.send(msgspec.structs.asdict(agent.info()))
        conn.send(wait_notifications(agent, timeout_s))
        conn.poll(timeout_s)  # the parent says stop (or dies)


@contextmanager
def spawned(
    target: Callable[[Connection, int, float], None],
) -> Iterator[tuple[mp.process.BaseProcess, Connection]]:
    """`target(conn, seed 7, TIMEOUT_S)` in a spawned process, asked to stop (or killed) after."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=target, args=(child_conn, 7, TIMEOUT_S), daemon=True)
    process.start()
    try:
        yield process, parent_conn
    finally:
        if process.is_alive():
            parent_conn.send("stop")
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)


@pytest.fixture
def source_process() -> Iterator[tuple[mp.process.BaseProcess, Connection]]:
    with spawned(serve_pool) as source:
        yield source


def receive(conn: Connection) -> object:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the source process did not answer")
    return conn.recv()


def test_read_from_another_process_notifies_it(
    source_process: tuple[mp.process.BaseProcess, Connection],
) -> None:
    process, conn = source_process
    info = KVPool(**receive(conn))  # type: ignore[arg-type]
    pool = make_pool(NUM_BLOCKS, seed=None)
    remote_ids, local_ids = [60, 0, 17, 18, 19, 5], [1, 2, 3, 40, 41, 63]
    with KVTransferAgent("gen-proc", pool, block_num_bytes(pool)) as reader:
        reader.add_peer(info)
        handle = reader.start_read("ctx-proc", remote_ids, local_ids, b"cmpl-42")
        assert wait_done(reader, handle) == "done", handle.error
        reader.release(handle)
        assert handle.num_bytes == 6 * reader.block_num_bytes
        assert receive(conn) == [("gen-proc", b"cmpl-42")]
    assert torch.equal(pool[local_ids], make_pool(NUM_BLOCKS, seed=7)[remote_ids])
    conn.send("stop")
    process.join(TIMEOUT_S)
    assert process.exitcode == 0


def test_read_from_a_dead_process_fails_instead_of_hanging(
    source_process: tuple[mp.process.BaseProcess, Connection],
) -> None:
    process, conn = source_process
    info = KVPool(**receive(conn))  # type: ignore[arg-type]
    pool = make_pool(NUM_BLOCKS, seed=None)
    with KVTransferAgent("gen-orphan", pool, block_num_bytes(pool)) as reader:
        reader.add_peer(info)
        process.kill()  # the context worker crashes while its blocks are leased
        process.join(5)
        started = time.monotonic()
        try:
            handle = reader.start_read("ctx-proc", [1, 2], [3, 4], b"lost", timeout_s=3.0)
        except KVTransferError:
            pass  # refused at post time: as good as "failed"
        else:
            assert wait_done(reader, handle) == "failed"
            assert handle.error
            reader.release(handle)
        assert time.monotonic() - started < 3.0 + 2.0
        with pytest.raises(KVTransferError, match="could not load peer 'ctx-proc'"):
            reader.add_peer(info)  # re-registering a dead worker fails loudly


def test_notify_without_a_transfer_reaches_the_source(
    pair: tuple[KVTransferAgent, KVTransferAgent],
) -> None:
    source, reader = pair
    reader.notify("ctx-0", b"cmpl-cached")
    assert wait_notifications(source) == [("gen-0", b"cmpl-cached")]
    with pytest.raises(KVTransferError, match="unknown peer"):
        reader.notify("nobody", b"x")
