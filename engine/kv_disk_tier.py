"""The KV offload tier's third level: blocks in files under a directory, bounded, LRU.

A block the host tier evicts (engine/kv_offload.py) lands here. Files are written by one background
thread so a step never waits for the disk; until its file is written, a block is served from the
copy queued for the writer. What the writer cannot keep up with is dropped, not waited for:

    put(h, bytes) ──▶ _pending[h] (in memory, readable) ──writer thread──▶ <dir>/<h>.kv (readable)
                            │ more than MAX_PENDING queued: the block is not kept (put -> False)
    evict LRU (over capacity): forgotten at once; its file is unlinked by the writer

Keys are the prefix cache's chained block hashes. The directory is this process's own (a fresh
subdirectory of the configured path), removed by close() or at interpreter exit; a killed worker
leaves it behind, and nothing ever reads another process's files.
"""

from __future__ import annotations

import atexit
import logging
import queue
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAX_PENDING = 64  # blocks queued for the writer; more are dropped rather than held in memory


class DiskTier:
    """Up to `capacity_bytes // block_num_bytes` blocks as files; LRU order, thread-safe reads."""

    def __init__(
        self, path: str, capacity_bytes: int, block_num_bytes: int, pin: bool = False
    ) -> None:
        """`pin`: a file is read into one pinned host buffer, then copied to the (GPU) pool,
        where numpy's pageable array made the driver stage every copy through its own."""
        self.capacity_blocks = capacity_bytes // block_num_bytes
        if self.capacity_blocks < 1:
            raise ValueError(
                f"disk tier of {capacity_bytes} bytes holds no {block_num_bytes}-byte block"
            )
        self.block_num_bytes = block_num_bytes
        self._staging = (
            torch.empty(block_num_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            if pin
            else None
        )
        Path(path).mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="kv-offload-", dir=path))
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, None] = OrderedDict()  # hash -> (), oldest first
        self._pending: dict[int, torch.Tensor] = {}  # queued for the writer, not yet on disk
        self._jobs: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()
        self._closed = False
        atexit.register(self.close)  # a worker ending normally leaves no files

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[int]:
        return list(self._entries)

    def put(self, block_hash: int, block: torch.Tensor) -> list[int] | None:
        """Keep a copy of `block` (any device); returns the hashes evicted to make room, or None
        when the block was not kept (the writer is behind)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return []
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                return None
            self._pending[block_hash] = block.detach().to("cpu", copy=True).view(torch.uint8)
        evicted = []
        while len(self._entries) >= self.capacity_blocks:
            old, _ = self._entries.popitem(last=False)
            evicted.append(old)
            with self._lock:
                self._pending.pop(old, None)
            self._jobs.put(("unlink", old))
        self._entries[block_hash] = None
        self._jobs.put(("write", block_hash))
        return evicted

    def read_into(self, block_hash: int, dst: torch.Tensor) -> bool:
        """Copy the block into `dst` (a pool block, any device); False when it is not held."""
        if block_hash not in self._entries:
            return False
        self._entries.move_to_end(block_hash)
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            data = pending
        else:
            try:  # the writer finished it: it stays on disk until unlinked by this thread's order
                data = self._read(block_hash)
            except OSError:
                logger.warning("KV disk tier: block %#x unreadable; recomputing it", block_hash)
                self._entries.pop(block_hash, None)
                return False
        dst.view(torch.uint8).view(-1).copy_(data.view(-1))  # synchronous: staging is reused
        return True

    def _read(self, block_hash: int) -> torch.Tensor:
        if self._staging is None:
            return torch.from_numpy(np.fromfile(self._file(block_hash), dtype=np.uint8))
        with self._file(block_hash).open("rb") as f:
            if f.readinto(self._staging.numpy()) != self.block_num_bytes:
                raise OSError(f"{self._file(block_hash)} is shorter than a block")
        return self._staging

    def remove(self, block_hash: int) -> None:
        if self._entries.pop(block_hash, "absent") is None:
            with self._lock:
                self._pending.pop(block_hash, None)
            self._jobs.put(("unlink", block_hash))

    def clear(self) -> None:
        for block_hash in list(self._entries):
            self.remove(block_hash)

    def flush(self) -> None:
        """Wait until every queued write and unlink is done (tests, close)."""
        self._jobs.join()

    def close(self) -> None:
        """Stop the writer and delete this tier's directory; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._jobs.put(None)
        self._writer.join(timeout=10)
        self._entries.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _file(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}.kv"

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                action, block_hash = job
                if action == "unlink":
                    self._file(block_hash).unlink(missing_ok=True)
                    continue
                with self._lock:
                    data = self._pending.get(block_hash)
                if data is None:  # evicted before it was written
                    continue
                tmp = self._file(block_hash).with_suffix(".tmp")
                data.numpy().tofile(tmp)
                tmp.rename(self._file(block_hash))  # readers see whole files only
                with self._lock:  # unless evicted and put again meanwhile
                    if self._pending.get(block_hash) is data:
                        del self._pending[block_hash]
            except OSError:
                logger.warning("KV disk tier: a write failed", exc_info=True)
            finally:
                self._jobs.task_done()
