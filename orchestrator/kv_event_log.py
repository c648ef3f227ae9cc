"""The cluster's KV events in TensorRT-LLM's JSON shape, queued for POST /kv_cache_events.

A bounded queue: a router that polls too slowly loses the oldest events (and can tell from the
event_id gap). Each event says which worker it is about. TensorRT-LLM has no "cleared" event: the
orchestrator reports a worker's AllBlocksCleared as the removal of every hash it holds. A block of
the offload tier (engine/kv_offload.py) is stored at TensorRT-LLM's `cache_level` 1 (host memory,
its secondary level) or 2 (disk), and its removal names its medium ("CPU", "DISK"), vLLM's field,
as TensorRT-LLM's removals cannot say which level lost the block; a pool block's is "GPU".

    {"event_id": 7, "worker_id": "gen-0", "data": {"type": "stored", "parent_hash": null,
     "blocks": [{"type": "stored_block", "block_hash": 123, "cache_level": 0, "priority": 35,
                 "tokens": [{"type": "unique_token", "token_id": 5, "token_extra_id": 0}, ...]}]}}
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from common.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, BlockStored

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority
CACHE_LEVELS = {MEDIUM_GPU: 0, None: 0, MEDIUM_CPU: 1, MEDIUM_DISK: 2}


class KVEventLog:
    """Stored events are kept as the worker sent them and rendered at drain: most fall off the
    queue unread, and rendered (a dict per token) each cost the orchestrator's loop a dict per
    token and left millions of them on its heap for the garbage collector to walk."""

    def __init__(self, max_events: int = 10_000) -> None:
        self._queue: deque[tuple[int, str, BlockStored | dict[str, Any]]] = deque(
            maxlen=max_events
        )  # (event_id, worker_id, data)
        self._next_id = 0

    def created(self, worker_id: str, num_blocks: int) -> None:
        """A worker (re)started with an empty cache."""
        self._append(worker_id, {"type": "created", "num_blocks_per_cache_level": [num_blocks]})

    def stored(self, worker_id: str, event: BlockStored) -> None:
        self._append(worker_id, event)

    def removed(
        self, worker_id: str, block_hashes: list[int], medium: str | None = MEDIUM_GPU
    ) -> None:
        if block_hashes:
            data = {"type": "removed", "block_hashes": block_hashes, "medium": medium or MEDIUM_GPU}
            self._append(worker_id, data)

    def drain(self) -> bytes:
        """Every queued event as a JSON array, oldest first; the queue is emptied."""
        events = [
            {"event_id": event_id, "worker_id": worker_id,
             "data": _stored(data) if isinstance(data, BlockStored) else data}
            for event_id, worker_id, data in self._queue
        ]  # fmt: skip
        self._queue.clear()
        return msgspec.json.encode(events)

    def _append(self, worker_id: str, data: BlockStored | dict[str, Any]) -> None:
        self._queue.append((self._next_id, worker_id, data))
        self._next_id += 1


def _stored(event: BlockStored) -> dict[str, Any]:
    size, level = event.block_size, CACHE_LEVELS.get(event.medium, 0)
    blocks = [
        {
            "type": "stored_block",
            "block_hash": block_hash,
            "cache_level": level,
            "priority": DEFAULT_PRIORITY,
            "tokens": [
                {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                for t in event.token_ids[i * size : (i + 1) * size]
            ],
        }
        for i, block_hash in enumerate(event.block_hashes)
    ]
    return {"type": "stored", "parent_hash": event.parent_block_hash, "blocks": blocks}
