"""KV cache events: what a worker's prefix cache gained or lost, in vLLM's wire format, and the
publisher routers subscribe to.

The engine records these structs as its block pool changes (engine/block_pool.py); each worker
step drains them and (1) sends them to the orchestrator, which feeds the kv_aware router and the
frontend's POST /kv_cache_events (TensorRT-LLM's JSON shape), and (2) when
`kv_cache.events.zmq` is set, publishes them on a ZMQ PUB socket as vLLM does:

    frames: topic │ sequence (8-byte big-endian, from 0, +1 per batch) │ msgpack KVEventBatch
    KVEventBatch = [ts, [event, ...], data_parallel_rank]          (a positional array)
    event        = {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., ...}

A subscriber that sees a sequence number jump knows it missed batches; it asks the replay ROUTER
with [b"", start_seq (8-byte big-endian)] and gets (b"", seq, payload) for every buffered batch
from there, then (b"", -1 as signed 8 bytes, b"") as the end marker.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec
import zmq

from common.curve import serve

# vLLM's `medium`: where a stored/removed block lives. "GPU" is the engine's pool on any device;
# "CPU" and "DISK" are the offload tier's levels (engine/kv_offload.py).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


class BlockStored(msgspec.Struct, tag=True):
    """Full blocks entered the prefix cache; `token_ids` holds all their tokens, concatenated."""

    block_hashes: list[int]
    parent_block_hash: int | None  # hash of the block before block_hashes[0]
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


class BlockRemoved(msgspec.Struct, tag=True):
    """Blocks were evicted: their hashes no longer resolve on this worker."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(msgspec.Struct, tag=True):
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
REPLAY_END = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """A worker's PUB socket (and replay ROUTER) for its KV events; driven by the worker loop."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        buffer_steps: int = 10_000,
    ) -> None:
        self.topic = topic.encode()
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        serve(self.pub)
        self.pub.bind(endpoint)
        self.replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            serve(self.replay)
            self.replay.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0

    @property
    def endpoint(self) -> str:
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[KVEvent]) -> None:
        payload = _encoder.encode(KVEventBatch(ts=time.time(), events=events))
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def serve_replay(self) -> None:
        """Answer waiting replay requests (non-blocking): every buffered batch from start_seq."""
        if self.replay is None:
            return
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, start = frames[0], frames[-1]
            start_seq = int.from_bytes(start, "big") if len(start) == 8 else 0
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    self.replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([identity, b"", REPLAY_END, b""])

    def close(self) -> None:
        self.pub.close()
        if self.replay is not None:
            self.replay.close()
