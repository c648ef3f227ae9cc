"""CUDA graphs for decode-only steps: the model's forward captured once per batch-size bucket and
replayed, so a step costs one graph launch instead of a few hundred kernel launches from Python
(on an H200 the tiny model's 5 ms step at one sequence was all host time).

A captured graph replays fixed addresses and shapes, so each bucket owns static input buffers:

    a step of n decodes  ->  bucket B = the smallest of BUCKETS >= n (1, 2, 4, 8, 16, 24, 32 ...)
    token ids, positions, slots, block tables, context lens  ->  rows 0..n-1 of B's buffers
    rows n..B-1 (padding): token 0, position 0, slot -1 (the KV store skips it), an all-zero
        block table row, context length 1 (reads one key of block 0; its output is dropped)
    block tables are max_blocks wide (the longest sequence the engine admits), zero padded, so
        the decode kernel's split count, chosen from that width, is the same at every replay
    replay, then rows 0..n-1 of B's output hidden states are the step's

The host copies go through pinned staging buffers, so they are asynchronous copies the replay
follows on the stream. A graph is valid while the tensors it captured live where they did: the KV
pool (checked every step by its address, shape and dtype: `Fingerprint`) and the weights (a
caller that replaces them calls `invalidate`). Steps with prefill chunks, speculative proposals,
LoRA adapters or LongRoPE run eagerly (model_runner.py decides), and so does a model whose capture
fails (a host sync inside its forward): graphs are turned off for the engine, with a warning.

`capture=False` replays by running the forward eagerly over the same padded static buffers: the
bookkeeping and padding are then checked on a CPU (tests/unit/engine/test_cuda_graphs.py); only
`torch.cuda.graph` itself needs the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.models.decoder import CausalLM
from engine.models.layers import AttentionMetadata

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # store_kv and store_kv_ref skip negative slots


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch, and max_batch itself: at most 7
    padded rows a step past 8, and few graphs (each holds its own activations' memory)."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_batch} | set(range(8, max_batch, 8))
    return tuple(sorted(sizes | {max_batch}))


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `batch` rows; None when none does (the step runs eagerly)."""
    return next((b for b in buckets if b >= batch), None) if batch > 0 else None


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What the captured graphs read in place besides the weights: the KV pool."""

    pool_address: int
    pool_shape: tuple[int, ...]
    pool_dtype: torch.dtype

    @staticmethod
    def of(kv_cache: KVCache) -> Fingerprint:
        pool = kv_cache.pool
        return Fingerprint(pool.data_ptr(), tuple(pool.shape), pool.dtype)


@dataclass(slots=True)
class PaddedDecode:
    """A decode batch padded to a bucket, on the host: what is copied into the static buffers."""

    token_ids: torch.Tensor  # (bucket,) int64
    positions: torch.Tensor  # (bucket,) int64
    slots: torch.Tensor  # (bucket,) int64, PAD_SLOT in padding rows
    block_tables: torch.Tensor  # (bucket, max_blocks) int32, zeros past each table
    context_lens: torch.Tensor  # (bucket,) int32, 1 in padding rows


def pad_decode(
    token_ids: Sequence[int],
    positions: Sequence[int],
    slots: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    out: PaddedDecode,
) -> PaddedDecode:
    """The n real rows, then the bucket's padding rows (module docstring), written in place into
    `out`, host buffers of one bucket (the pinned staging buffers), through numpy views: a
    64 x 2048 block table costs a memset and 64 row copies, not 131k Python ints."""
    n, bucket = len(token_ids), out.token_ids.shape[0]
    max_blocks = out.block_tables.shape[1]
    if not 0 < n <= bucket:
        raise ValueError(f"{n} decodes do not fit a bucket of {bucket}")
    for name, values, pad in (
        ("token_ids", token_ids, 0),
        ("positions", positions, 0),
        ("slots", slots, PAD_SLOT),
        ("context_lens", context_lens, 1),
    ):
        view = getattr(out, name).numpy()
        view[:n] = values
        view[n:] = pad
    tables = out.block_tables.numpy()
    tables.fill(0)
    for row, table in enumerate(block_tables):
        if len(table) > max_blocks:
            raise ValueError(f"a block table of {len(table)} blocks; the graphs hold {max_blocks}")
        tables[row, : len(table)] = table
    return out


def empty_padded(bucket: int, max_blocks: int, device: str, pin: bool = False) -> PaddedDecode:
    """All-padding buffers of a bucket (what a graph is captured over: it writes no KV)."""

    def full(value: int, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.full(shape, value, dtype=dtype, device=device, pin_memory=pin)

    return PaddedDecode(
        token_ids=full(0, bucket),
        positions=full(0, bucket),
        slots=full(PAD_SLOT, bucket),
        block_tables=full(0, bucket, max_blocks, dtype=torch.int32),
        context_lens=full(1, bucket, dtype=torch.int32),
    )


class BucketGraph:
    """One bucket's static buffers (device and pinned host) and its captured forward."""

    def __init__(
        self,
        bucket: int,
        max_blocks: int,
        device: str,
        forward: Callable[[PaddedDecode], torch.Tensor],
        capture: bool,
        pool: object | None,
    ) -> None:
        self.bucket = bucket
        self.max_blocks = max_blocks
        on_cuda = torch.device(device).type == "cuda"
        self.inputs = empty_padded(bucket, max_blocks, device)
        self.staging = empty_padded(bucket, max_blocks, "cpu", pin=on_cuda)
        self.forward = forward
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        # recorded after the last step's copies out of the staging buffers: the next step waits
        # on it before writing them (a step's sampler syncs anyway; this does not rely on it)
        self.copied: torch.cuda.Event | None = None
        if capture:
            forward(self.inputs)  # compiles the kernels and warms the allocator outside capture
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: a worker's other threads (NIXL's UCX progress thread) may call CUDA
            # meanwhile; only this thread's calls must be capturable
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.output = forward(self.inputs)

    def run(self, padded_rows: Callable[[PaddedDecode], PaddedDecode], n: int) -> torch.Tensor:
        """Fill the staging buffers, copy them in, replay; the first n rows of the output."""
        if self.copied is not None:
            self.copied.synchronize()
        padded_rows(self.staging)
        for name in PaddedDecode.__slots__:
            getattr(self.inputs, name).copy_(getattr(self.staging, name), non_blocking=True)
        if self.graph is None:
            output = self.forward(self.inputs)
        else:
            self.copied = torch.cuda.Event()
            self.copied.record()
            self.graph.replay()
            assert self.output is not None
            output = self.output
        return output[:n].clone()  # the next replay, of any bucket, may overwrite the output


class DecodeGraphs:
    """The engine's captured decode steps, one per bucket, captured on first use."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        backend: str,
        device: str,
        max_batch: int,
        max_blocks: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.buckets = buckets_for(max_batch)
        self.max_blocks = max_blocks
        self.capture = capture
        self.enabled = True
        self.graphs: dict[int, BucketGraph] = {}
        self.fingerprint = Fingerprint.of(kv_cache)
        self.num_captures = 0  # graphs captured since start (a test's and a log's count)
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, batch: int, block_tables: Sequence[Sequence[int]]) -> bool:
        return (
            self.enabled
            and bucket_for(batch, self.buckets) is not None
            and all(len(t) <= self.max_blocks for t in block_tables)
        )

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (the smaller ones reuse its memory pool), so
        that no serving step pays for a capture."""
        for bucket in sorted(self.buckets, reverse=True):
            if self._graph(bucket) is None:
                return

    def invalidate(self) -> None:
        """Drop every graph (the weights or the KV pool they read moved); later steps capture."""
        self.graphs.clear()
        if self.capture:
            self._pool = torch.cuda.graph_pool_handle()

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
    ) -> torch.Tensor | None:
        """The decode batch's final hidden states (n, hidden), or None where it must run
        eagerly (no bucket holds it, or capturing failed: graphs are then off for good)."""
        n = len(token_ids)
        bucket = bucket_for(n, self.buckets)
        if not self.enabled or bucket is None:
            return None
        now = Fingerprint.of(self.kv_cache)
        if now != self.fingerprint:
            logger.info("the KV pool moved: dropping %d CUDA graphs", len(self.graphs))
            self.invalidate()
            self.fingerprint = now
        graph = self._graph(bucket)
        if graph is None:
            return None

        def rows(staging: PaddedDecode) -> PaddedDecode:
            return pad_decode(token_ids, positions, slots, block_tables, context_lens, staging)

        return graph.run(rows, n)

    def _graph(self, bucket: int) -> BucketGraph | None:
        """The bucket's graph, captured now if need be; None (graphs off) if capture fails."""
        graph = self.graphs.get(bucket)
        if graph is not None or not self.enabled:
            return graph
        try:
            graph = BucketGraph(
                bucket, self.max_blocks, self.device, self._forward, self.capture, self._pool
            )
        except Exception:
            logger.warning("CUDA graph capture failed: decode steps run eagerly", exc_info=True)
            self.enabled = False
            self.graphs.clear()
            return None
        self.graphs[bucket] = graph
        self.num_captures += 1
        return graph

    def _forward(self, inputs: PaddedDecode) -> torch.Tensor:
        bucket, dev = inputs.token_ids.shape[0], self.device
        meta = AttentionMetadata(
            slot_mapping=inputs.slots,
            num_decode_tokens=bucket,
            decode_block_tables=inputs.block_tables,
            decode_context_lens=inputs.context_lens,
            prefill_block_tables=torch.zeros(0, self.max_blocks, dtype=torch.int32, device=dev),
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            backend=self.backend,  # type: ignore[arg-type]
        )
        return self.model(inputs.token_ids, inputs.positions, self.kv_cache.layers, meta)
