"""The KV-aware router and the event log with the offload tier's events (medium CPU / DISK)."""

from __future__ import annotations

import json
import random

from common.config import parse_cluster_config
from common.kv_events import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored
from common.protocol import KVEvents, PrefillRequest, Registered
from orchestrator.orchestrator import Orchestrator
from orchestrator.registry import WorkerRecord
from orchestrator.router import TIER_HIT_WEIGHT, KVAwareRouter, PrefixIndex
from tests.unit.orchestrator.test_orchestrator import FRONTEND, generate, register


def workers(*loads: int) -> list[WorkerRecord]:
    return [
        WorkerRecord(f"w{i}", "context", 1, "", None, 0.0, active_tokens=load)
        for i, load in enumerate(loads)
    ]


def test_a_tier_hit_counts_less_than_a_pool_hit_and_more_than_a_miss() -> None:
    index = PrefixIndex()
    router = KVAwareRouter(index, block_size=16, rng=random.Random(0))
    hashes = [11, 12, 13, 14]
    index.stored("w0", hashes, MEDIUM_CPU)  # w0: the whole prompt in its host tier
    assert router.pick(workers(0, 0), hashes).worker_id == "w0"  # vs a miss on w1
    index.stored("w1", hashes)  # w1: the whole prompt in its pool
    assert router.pick(workers(0, 0), hashes).worker_id == "w1"
    # the tier's discount is worth TIER_HIT_WEIGHT x 4 blocks of load (x 16 tokens) to w0
    load = int(TIER_HIT_WEIGHT * 4 * 16)
    assert router.pick(workers(0, load + 16), hashes).worker_id == "w0"


def test_tier_prefix_continues_the_pool_prefix_across_levels() -> None:
    index = PrefixIndex()
    hashes = [11, 12, 13, 14, 15]
    index.stored("w0", [11, 12])
    index.stored("w0", [13], MEDIUM_CPU)
    index.stored("w0", [14], MEDIUM_DISK)
    index.stored("w1", [12, 13], MEDIUM_CPU)  # not the first block: nothing reusable
    cached = index.cached_prefixes(["w0", "w1"], hashes)
    assert cached == {"w0": 2}
    assert index.tier_prefixes(["w0", "w1"], hashes, cached) == {"w0": 2}
    index.removed("w0", [13], MEDIUM_CPU)  # the chain breaks at 13
    assert index.tier_prefixes(["w0", "w1"], hashes, cached) == {}
    index.removed("w0", [11])  # a pool removal leaves the tier's entries
    assert index.held("w0") == {12, 14}
    index.cleared("w0")
    assert index.held("w0") == set()


def test_orchestrator_indexes_and_logs_tier_events_by_medium() -> None:
    orchestrator = Orchestrator(parse_cluster_config(""))
    events = [
        BlockStored([1, 2], None, [10, 11, 12, 13], 2),
        BlockRemoved([1, 2]),
        BlockStored([1, 2], None, [], 2, medium=MEDIUM_CPU),
        BlockRemoved([1], medium=MEDIUM_CPU),
        BlockStored([1], None, [], 2, medium=MEDIUM_DISK),
    ]
    orchestrator.on_kv_events(KVEvents(worker_id="ctx-0", events=events))
    index = orchestrator.prefix_index
    assert index.num_cached_blocks("ctx-0", [1, 2]) == 0
    assert index.tier_prefixes(["ctx-0"], [1, 2], {}) == {"ctx-0": 2}
    logged = [e["data"] for e in json.loads(orchestrator.kv_events.drain())]
    assert [d["type"] for d in logged] == ["stored", "removed", "stored", "removed", "stored"]
    levels = [[b["cache_level"] for b in d["blocks"]] for d in logged if d["type"] == "stored"]
    assert levels == [[0, 0], [1, 1], [2]]
    assert [d["medium"] for d in logged if d["type"] == "removed"] == ["GPU", "CPU"]


def test_tier_peer_is_the_worker_whose_host_tier_continues_the_prefix_furthest() -> None:
    index = PrefixIndex()
    hashes = [11, 12, 13, 14]
    index.stored("w0", [11])  # the chosen worker holds block 0
    index.stored("w1", [12, 13], MEDIUM_CPU)  # blocks 1-2, in its host tier
    index.stored("w2", [12, 13, 14], MEDIUM_CPU)  # blocks 1-3
    index.stored("w3", [12, 13, 14], MEDIUM_DISK)  # not readable by peers
    assert index.tier_peer("w0", ["w1", "w2", "w3"], hashes) == "w2"
    assert index.tier_peer("w0", ["w1", "w3"], hashes) == "w1"
    assert index.tier_peer("w2", ["w0", "w1"], hashes) is None  # w0 has nothing past block 0
    index.stored("w0", [12, 13, 14], MEDIUM_CPU)
    assert index.tier_peer("w0", ["w1", "w2"], hashes) is None  # nothing the others add


def test_prefill_names_a_peer_tier_and_context_workers_get_the_peer_set() -> None:
    yaml = "kv_cache: {offload: {host_bytes: 1000000}}\norchestrator: {router: round_robin}"
    orch = Orchestrator(parse_cluster_config(yaml))
    outs = [register(orch, f"ctx-{i}", "context") for i in range(2)]
    outs += [register(orch, "gen-0", "generation"), register(orch, "pp-0", "postproc")]
    outs.append(orch.tick(1.0))
    # with the tier on, context workers get the peer set too (each other's tiers)
    updates = [(t, m) for out in outs for t, m in out if isinstance(m, Registered)]
    assert {t for t, m in updates if len(m.peers) == 2} >= {b"ctx-0", b"ctx-1", b"gen-0"}
    request = generate("cmpl-tier", num_tokens=40)
    held = request.prompt_block_hashes[:2]
    orch.on_kv_events(
        KVEvents(worker_id="ctx-1", events=[BlockStored(held, None, [], 16, medium=MEDIUM_CPU)])
    )
    sent = [(t, m) for t, m in orch.handle(FRONTEND, request, 1.0) if isinstance(m, PrefillRequest)]
    [(target, prefill)] = sent
    expected = None if target == b"ctx-1" else "ctx-1-agent"
    assert prefill.tier_peer == expected
