"""Pick a worker for a request: round robin, least loaded, or KV-aware.

The KV-aware router scores each worker by
    cost = overlap_weight × (prompt blocks NOT in its pool − TIER_HIT_WEIGHT × blocks in its
           offload tier after those) + (active tokens / block_size)
and takes the cheapest (ties broken at random). A block in a worker's offload tier (medium "CPU"
or "DISK", engine/kv_offload.py) is copied back rather than recomputed there, but the copy is not
free, so it counts half a pool hit. Its knowledge of what each worker caches comes from the
workers' KV events through `PrefixIndex`; a worker without events yet is scored by load alone,
which makes the router least-loaded until events flow.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence

from common.kv_events import MEDIUM_CPU, MEDIUM_GPU
from orchestrator.registry import WorkerRecord

# A tier hit's worth against a pool hit (1) and a miss (0): restoring a block is a host-memory (or
# disk) copy, far cheaper than its prefill but not free like a hit in the pool.
TIER_HIT_WEIGHT = 0.5


class RoundRobinRouter:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[WorkerRecord], block_hashes: Sequence[int]) -> WorkerRecord:
        return workers[next(self._counter) % len(workers)]


class LeastLoadedRouter:
    """The worker with the fewest active tokens (prompt + max_tokens of its open requests)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, workers: Sequence[WorkerRecord], block_hashes: Sequence[int]) -> WorkerRecord:
        least = min(w.active_tokens for w in workers)
        return self.rng.choice([w for w in workers if w.active_tokens == least])


class PrefixIndex:
    """Which block hashes each worker holds, fed by its KV events (stored / removed / cleared):
    in its pool (medium "GPU", or none given) and in each level of its offload tier."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}
        self._tiers: dict[str, dict[str, set[int]]] = {}  # worker -> medium -> hashes

    def stored(
        self, worker_id: str, block_hashes: Sequence[int], medium: str | None = MEDIUM_GPU
    ) -> None:
        self._held(worker_id, medium).update(block_hashes)

    def removed(
        self, worker_id: str, block_hashes: Sequence[int], medium: str | None = MEDIUM_GPU
    ) -> None:
        self._held(worker_id, medium).difference_update(block_hashes)

    def cleared(self, worker_id: str) -> None:
        self._blocks[worker_id] = set()
        self._tiers.pop(worker_id, None)

    def held(self, worker_id: str) -> set[int]:
        """Every hash the worker holds, in its pool or a tier."""
        held = set(self._blocks.get(worker_id, ()))
        for hashes in self._tiers.get(worker_id, {}).values():
            held |= hashes
        return held

    def forget(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
        self._tiers.pop(worker_id, None)

    def _held(self, worker_id: str, medium: str | None) -> set[int]:
        if medium is None or medium == MEDIUM_GPU:
            return self._blocks.setdefault(worker_id, set())
        return self._tiers.setdefault(worker_id, {}).setdefault(medium, set())

    def num_cached_blocks(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """Length of the prompt's longest prefix (in blocks) the worker holds; chained hashes make
        a prefix match the only kind that can be reused."""
        held = self._blocks.get(worker_id, set())
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def cached_prefixes(
        self, worker_ids: Iterable[str], block_hashes: Sequence[int]
    ) -> dict[str, int]:
        """`num_cached_blocks` of the workers that hold the prompt's first block (the others
        hold none of it): one lookup per worker, and a walk along the prompt only on those few.
        The router asks this of every worker of a role for every request."""
        if not block_hashes:
            return {}
        first, blocks = block_hashes[0], self._blocks
        return {
            worker_id: self.num_cached_blocks(worker_id, block_hashes)
            for worker_id in worker_ids
            if first in blocks.get(worker_id, ())
        }

    def tier_prefixes(
        self, worker_ids: Iterable[str], block_hashes: Sequence[int], cached: dict[str, int]
    ) -> dict[str, int]:
        """For workers with an offload tier: how many blocks past their pool prefix (`cached`,
        from cached_prefixes) the prompt's prefix continues in the tier (or the pool again)."""
        if not self._tiers or not block_hashes:
            return {}
        found = {}
        for worker_id in worker_ids:
            tiers = self._tiers.get(worker_id)
            if not tiers:
                continue
            pool = self._blocks.get(worker_id, set())
            start = cached.get(worker_id, 0)
            count = 0
            for block_hash in block_hashes[start:]:
                if block_hash not in pool and not any(block_hash in t for t in tiers.values()):
                    break
                count += 1
            if count:
                found[worker_id] = count
        return found

    def tier_peer(
        self, worker_id: str, others: Iterable[str], block_hashes: Sequence[int]
    ) -> str | None:
        """Another worker whose host tier (medium "CPU", readable over NIXL) holds the blocks
        right after the prompt's prefix that `worker_id` holds, pool and tiers; the one with the
        most of them, or None."""
        if not self._tiers or not block_hashes:
            return None
        pool = self._blocks.get(worker_id, set())
        own = self._tiers.get(worker_id, {}).values()
        reach = 0
        for block_hash in block_hashes:
            if block_hash not in pool and not any(block_hash in t for t in own):
                break
            reach += 1
        best, best_count = None, 0
        for other in others:
            host = self._tiers.get(other, {}).get(MEDIUM_CPU)
            if not host or other == worker_id:
                continue
            count = 0
            for block_hash in block_hashes[reach:]:
                if block_hash not in host:
                    break
                count += 1
            if count > best_count:
                best, best_count = other, count
        return best


class KVAwareRouter:
    def __init__(
        self,
        index: PrefixIndex,
        block_size: int,
        overlap_weight: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.rng = rng or random.Random()

    def pick(self, workers: Sequence[WorkerRecord], block_hashes: Sequence[int]) -> WorkerRecord:
        worker_ids = [w.worker_id for w in workers]
        cached = self.index.cached_prefixes(worker_ids, block_hashes)
        tiered = self.index.tier_prefixes(worker_ids, block_hashes, cached)
        weight, num_blocks, block_size = self.overlap_weight, len(block_hashes), self.block_size
        costs = [
            weight
            * (
                num_blocks
                - cached.get(w.worker_id, 0)
                - TIER_HIT_WEIGHT * tiered.get(w.worker_id, 0)
            )
            + w.active_tokens / block_size
            for w in workers
        ]  # the cost of the module's docstring, inlined: this runs per worker per request
        least = min(costs)
        return self.rng.choice([w for w, c in zip(workers, costs, strict=True) if c == least])


Router = RoundRobinRouter | LeastLoadedRouter | KVAwareRouter


def make_router(name: str, index: PrefixIndex, block_size: int) -> Router:
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "least_loaded":
        return LeastLoadedRouter()
    return KVAwareRouter(index, block_size)
