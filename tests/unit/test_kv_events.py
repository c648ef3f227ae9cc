"""KV events: the wire format round-trips, the orchestrator's log speaks TensorRT-LLM's JSON, and
each engine worker gets its own publishing port."""

from __future__ import annotations

import gc
import json

import msgspec

from common.config import parse_cluster_config
from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from common.protocol import KVEvents
from engine.worker_bridge import event_endpoints
from orchestrator.kv_event_log import KVEventLog
from orchestrator.orchestrator import Orchestrator


def test_batches_are_positional_with_tagged_event_maps() -> None:
    batch = KVEventBatch(
        ts=1.5, events=[BlockStored([7, 8], None, list(range(8)), 4), AllBlocksCleared()]
    )
    payload = msgspec.msgpack.encode(batch)
    raw = msgspec.msgpack.decode(payload)
    assert (
        raw[0] == 1.5
        and raw[1][0]["type"] == "BlockStored"
        and raw[1][1] == {"type": "AllBlocksCleared"}
    )
    assert raw[1][0]["block_hashes"] == [7, 8] and raw[1][0]["parent_block_hash"] is None
    assert msgspec.msgpack.Decoder(KVEventBatch).decode(payload) == batch


def test_log_drains_tensorrt_llm_events_and_expands_cleared() -> None:
    orchestrator = Orchestrator(parse_cluster_config(""))
    log = orchestrator.kv_events
    log.created("gen-0", 64)
    stored = BlockStored([1, 2], None, [10, 11, 12, 13], 2)
    orchestrator.on_kv_events(KVEvents(worker_id="gen-0", events=[stored, BlockRemoved([1])]))
    orchestrator.on_kv_events(KVEvents(worker_id="gen-0", events=[AllBlocksCleared()]))
    assert orchestrator.prefix_index.held("gen-0") == set()
    events = json.loads(log.drain())
    assert [e["data"]["type"] for e in events] == ["created", "stored", "removed", "removed"]
    assert [e["event_id"] for e in events] == [0, 1, 2, 3]
    stored = events[1]["data"]
    assert [b["block_hash"] for b in stored["blocks"]] == [1, 2]
    assert [t["token_id"] for t in stored["blocks"][1]["tokens"]] == [12, 13]
    assert events[3]["data"]["block_hashes"] == [2]  # cleared: what was still held
    assert json.loads(log.drain()) == []


def test_a_slow_poller_loses_the_oldest_events_and_sees_the_gap() -> None:
    log = KVEventLog(max_events=2)
    for i in range(5):
        log.removed("ctx-0", [i])
    assert [e["event_id"] for e in json.loads(log.drain())] == [3, 4]


def test_stored_events_cost_no_object_per_token_until_drained() -> None:
    """Every KV event passes through the orchestrator's one loop, and few are ever drained: a
    dict per token rendered on arrival cost that loop its time and left millions of objects
    for the garbage collector to walk (bench/orchestrator_load.py, 10^6 cached blocks)."""
    log = KVEventLog()
    events = [BlockStored(list(range(32)), None, list(range(32 * 16)), 16) for _ in range(100)]
    gc.collect()
    before = len(gc.get_objects())
    for event in events:
        log.stored("gen-0", event)
    assert len(gc.get_objects()) - before < 2 * len(events)
    drained = json.loads(log.drain())
    assert len(drained) == 100 and len(drained[0]["data"]["blocks"][31]["tokens"]) == 16


def test_each_engine_worker_publishes_on_its_own_port() -> None:
    config = parse_cluster_config(
        "generation_workers: {count: 2}\n"
        'kv_cache: {events: {zmq: "tcp://127.0.0.1:5557", replay_zmq: "tcp://127.0.0.1:6557"}}'
    )
    assert event_endpoints(config, "gen-0") == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:6557")
    assert event_endpoints(config, "gen-1") == ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:6558")
    assert event_endpoints(config, "ctx-0") == ("tcp://127.0.0.1:5559", "tcp://127.0.0.1:6559")
    assert event_endpoints(parse_cluster_config(""), "gen-0") == (None, None)


def test_workers_in_their_own_pods_all_bind_the_configured_port() -> None:
    config = parse_cluster_config('kv_cache: {events: {zmq: "tcp://0.0.0.0:5557"}}')
    assert event_endpoints(config, "gen-3") == ("tcp://0.0.0.0:5557", None)
