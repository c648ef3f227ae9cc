"""NIXL pull bandwidth between two processes against an in-process copy of the same blocks.

A source process owns a 256 MiB pool (like a context worker's KV pool) and this process pulls
every block of it into its own pool with KVTransferAgent READs, block ids shuffled on both sides
as in a paged cache. Each block size is read as one request of all blocks and as back-to-back
requests of `--chunk-mib`. The baseline copies the same blocks inside one process (torch
index_select + index_copy_, and a plain contiguous copy as the memory-bandwidth ceiling). Figures
are medians of `--repeats`.

    .venv/bin/python -m bench.transfer [--out bench/results/transfer.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch

from common.protocol import KVPool
from engine.kv_transfer import KVTransferAgent, TransferHandle

ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20
TIMEOUT_S = 60.0


def make_pool(total_bytes: int, block_bytes: int, seed: int | None) -> torch.Tensor:
    """(num_blocks, block_bytes) uint8: zeros, or a seeded pattern both processes can rebuild."""
    shape = (total_bytes // block_bytes, block_bytes)
    if seed is None:
        return torch.zeros(shape, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def serve_pools(conn: Connection, total_bytes: int, seed: int) -> None:
    """Source process: on ("pool", block_bytes) own a fresh pool and send its info; count
    notifications until ("drop",), then report the count; exit on ("stop",)."""
    agent: KVTransferAgent | None = None
    num_notifications = 0
    while True:
        if not conn.poll(0.01):
            if agent is not None:
                num_notifications += len(agent.take_notifications())
            continue
        message = conn.recv()
        if message[0] == "pool":
            pool = make_pool(total_bytes, message[1], seed)
            agent = KVTransferAgent(f"src-{message[1]}", pool, message[1])
            num_notifications = 0
            conn.send(msgspec.structs.asdict(agent.info()))
        elif message[0] == "drop" and agent is not None:
            deadline = time.monotonic() + TIMEOUT_S
            while num_notifications < message[1] and time.monotonic() < deadline:
                num_notifications += len(agent.take_notifications())
                time.sleep(0.001)
            agent.close()
            agent = None
            conn.send(num_notifications)
        else:
            return


def receive(conn: Connection) -> object:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the source process did not answer")
    return conn.recv()


def wait(agent: KVTransferAgent, handle: TransferHandle) -> None:
    while agent.poll(handle) == "pending":
        time.sleep(0.0002)
    agent.release(handle)
    if handle.state != "done":
        raise RuntimeError(f"READ {handle.transfer_id} failed: {handle.error}")


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def row(method: str, block_bytes: int, request_bytes: int, total: int, times: list[float]) -> dict:
    median_s = statistics.median(times)
    return {
        "method": method,
        "block_bytes": block_bytes,
        "request_bytes": request_bytes,
        "num_requests": total // request_bytes,
        "total_bytes": total,
        "median_s": round(median_s, 6),
        "gib_per_s": round(total / median_s / (1 << 30), 3),
        "times_s": [round(t, 6) for t in times],
    }


def bench_block_size(
    conn: Connection, block_bytes: int, args: argparse.Namespace, seed: int
) -> list[dict]:
    total = args.total_mib * MIB
    num_blocks = total // block_bytes
    conn.send(("pool", block_bytes))
    info = KVPool(**receive(conn))  # type: ignore[arg-type]
    dst = make_pool(total, block_bytes, seed=None)
    shuffle = torch.Generator().manual_seed(block_bytes)
    remote_ids = torch.randperm(num_blocks, generator=shuffle)
    local_ids = torch.randperm(num_blocks, generator=shuffle)
    chunk_blocks = args.chunk_mib * MIB // block_bytes
    num_reads = 0
    rows = []
    with KVTransferAgent(f"dst-{block_bytes}", dst, block_bytes) as reader:
        reader.add_peer(info)

        def read(blocks_per_request: int) -> None:
            nonlocal num_reads
            for start in range(0, num_blocks, blocks_per_request):
                end = start + blocks_per_request
                handle = reader.start_read(
                    info.agent_name,
                    remote_ids[start:end].tolist(),
                    local_ids[start:end].tolist(),
                    b"bench-%d" % num_reads,
                    timeout_s=TIMEOUT_S,
                )
                num_reads += 1
                wait(reader, handle)

        read(num_blocks)  # warm-up: connection set-up and first touch of the pages
        src = make_pool(total, block_bytes, seed)
        if not torch.equal(dst[local_ids], src[remote_ids]):
            raise AssertionError(f"{block_bytes}-byte blocks: READ delivered wrong bytes")
        for blocks_per_request in (num_blocks, chunk_blocks):
            times = timed(lambda n=blocks_per_request: read(n), args.repeats)
            rows.append(
                row("nixl_read", block_bytes, blocks_per_request * block_bytes, total, times)
            )
    conn.send(("drop", num_reads))
    if receive(conn) != num_reads:
        raise AssertionError("the source missed notifications")

    dst.zero_()
    # int64 views: torch gathers uint8 rows element by element, 2-3x slower than 8-byte words
    src64, dst64 = src.view(torch.int64), dst.view(torch.int64)
    times = timed(
        lambda: dst64.index_copy_(0, local_ids, src64.index_select(0, remote_ids)), args.repeats
    )
    if not torch.equal(dst[local_ids], src[remote_ids]):
        raise AssertionError("the in-process copy is wrong")
    rows.append(row("torch_gather_index_copy", block_bytes, total, total, times))
    times = timed(lambda: dst.copy_(src), args.repeats)
    rows.append(row("torch_contiguous_copy", block_bytes, total, total, times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--block-kib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--chunk-mib", type=int, default=4, help="request size of the chunked run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/transfer.json")
    args = parser.parse_args()

    seed = 1234
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    source = ctx.Process(
        target=serve_pools, args=(child_conn, args.total_mib * MIB, seed), daemon=True
    )
    source.start()
    rows = []
    try:
        for block_kib in args.block_kib:
            rows += bench_block_size(conn, block_kib * 1024, args, seed)
            for r in rows[-4:]:
                print(
                    f"{r['method']:<24} block {r['block_bytes'] // 1024:>3} KiB"
                    f"  request {r['request_bytes'] / MIB:>6.1f} MiB"
                    f"  {r['median_s'] * 1e3:8.2f} ms  {r['gib_per_s']:6.2f} GiB/s"
                )
        conn.send(("stop",))
    finally:
        source.join(10)
        if source.is_alive():
            source.kill()
    result = {
        "what": "NIXL READ (UCX, DRAM, separate processes) vs in-process torch copy, medians",
        "transport": "same-host DRAM: UCX reads with CMA (process_vm_readv) inside the post",
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "nixl": importlib.metadata.version("nixl"),
        },
        "repeats": args.repeats,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
