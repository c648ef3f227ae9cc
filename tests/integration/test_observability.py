"""KV events, KV-aware routing, /metrics and the profiler routes on a disaggregated cluster with
two generation workers."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import PROTOCOL_VERSION
from frontend.openapi import ROUTES
from tests.integration.harness import MODEL, Cluster, free_port

PROFILED_STEPS = 20  # fewer than the requests of the profile test take on a generation worker
LONG_PREFIX = (
    "The river carried the boats of the traders down to the harbour, where the merchants "
    "counted their coins and argued about the weather, the prices of salt and the roads. "
) * 3


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def cluster(start_cluster, profile_dir: Path) -> Cluster:
    # engine worker k binds the base port + k (gen-0, gen-1, ctx-0): three free ports each
    events = free_port(6)
    replay = events + 3
    kv_cache = (
        f'events: {{zmq: "tcp://127.0.0.1:{events}", replay_zmq: "tcp://127.0.0.1:{replay}"}}'
    )
    profiler = f"profiler: {{dir: {profile_dir}, max_steps: {PROFILED_STEPS}}}\n"
    extra = f"generation_workers: {{count: 2}}\n{profiler}"
    return start_cluster("disaggregated", extra=extra, kv_cache=kv_cache)


def complete(cluster: Cluster, prompt: str, max_tokens: int = 4) -> openai.types.Completion:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=60, max_retries=0)
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )


def by_worker(cluster: Cluster, role: str = "generation") -> dict:
    return {w.worker_id: w for w in cluster.wait_idle().workers if w.role == role}


def test_kv_aware_router_sends_a_shared_prefix_to_the_worker_that_holds_it(cluster) -> None:
    before = by_worker(cluster)
    first = complete(cluster, LONG_PREFIX + "First question?")
    middle = by_worker(cluster)
    holder = next(i for i in middle if middle[i].generation_tokens > before[i].generation_tokens)
    complete(cluster, LONG_PREFIX + "A second, different question?")
    after = by_worker(cluster)
    assert after[holder].generation_tokens > middle[holder].generation_tokens  # routed there
    for other in set(after) - {holder}:
        assert after[other].generation_tokens == middle[other].generation_tokens
    hits = after[holder].prefix_cache_hit_tokens - middle[holder].prefix_cache_hit_tokens
    assert hits >= (first.usage.prompt_tokens // 16 - 1) * 16  # its own cache served the prefix
    scrape = metrics(cluster)
    assert scrape["pdcluster_prefix_cache_hit_tokens_total"][(holder, "generation")] >= hits


def test_kv_cache_events_in_tensorrt_llm_shape(cluster) -> None:
    httpx.post(f"{cluster.url}/kv_cache_events", timeout=10)  # drain what came before
    complete(cluster, LONG_PREFIX + "Events, please.")
    cluster.wait_idle()
    events = httpx.post(f"{cluster.url}/kv_cache_events", timeout=10).json()
    stored = [e for e in events if e["data"]["type"] == "stored"]
    assert stored, events
    ids = [e["event_id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    block = stored[0]["data"]["blocks"][0]
    assert block["type"] == "stored_block" and isinstance(block["block_hash"], int)
    assert len(block["tokens"]) == 16 and block["tokens"][0]["type"] == "unique_token"
    assert {e["worker_id"] for e in stored} <= {"ctx-0", "gen-0", "gen-1"}
    assert httpx.post(f"{cluster.url}/kv_cache_events", timeout=10).json() == []  # drained


def decode_batch(payload: bytes) -> tuple[float, list[dict]]:
    """vLLM's KVEventBatch read from its published format: [ts, [event map, ...], dp_rank]."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) in (2, 3)
    return batch[0], batch[1]


def test_zmq_subscriber_decodes_event_batches_and_sequences_have_no_gaps(cluster) -> None:
    # The router may send the prompt to either generation worker (ties break at random), so
    # listen to both and check the one that stored it.
    gens = {w.worker_id: w for w in cluster.info().workers if w.role == "generation"}
    context = cluster.insider_context()  # KV events are internal sockets: CURVE like the rest
    subs = {worker_id: context.socket(zmq.SUB) for worker_id in gens}
    for worker_id, sub in subs.items():
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(gens[worker_id].events_address)
    time.sleep(0.5)  # a SUB socket misses what is published before it joins
    try:
        complete(cluster, "Subscriber test. " + LONG_PREFIX)
        seen: dict[str, list[tuple[int, list[dict]]]] = {worker_id: [] for worker_id in subs}
        for worker_id, sub in subs.items():
            while sub.poll(2000):
                topic, seq, payload = sub.recv_multipart()
                assert len(seq) == 8
                seen[worker_id].append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))
        holders = [
            worker_id
            for worker_id, batches in seen.items()
            if any(e["type"] == "BlockStored" for _, events in batches for e in events)
        ]
        assert len(holders) == 1, seen  # the one worker the prompt went to
        holder = holders[0]
        stored = [e for _, events in seen[holder] for e in events if e["type"] == "BlockStored"]
        assert all(isinstance(h, int) for h in stored[0]["block_hashes"])
        assert stored[0]["block_size"] == 16 and len(stored[0]["token_ids"]) % 16 == 0
        seqs = [s for s, _ in seen[holder]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: no gap
        replayed = replay(context, gens[holder].events_address, cluster, start=0)
        assert [s for s, _ in replayed] == list(range(len(replayed)))  # from 0, gap-free
        assert replayed[-len(seqs) :] == [(s, p) for s, p in replayed if s >= seqs[0]][: len(seqs)]
    finally:
        for sub in subs.values():
            sub.close()
        context.term()


def replay(context: zmq.Context, events_address: str, cluster: Cluster, start: int) -> list:
    """Ask the replay socket for every batch from `start`, until the -1 end marker."""
    replay_address = replay_endpoint_of(cluster, events_address)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_address)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    try:
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return batches
            batches.append((number, payload))
        raise AssertionError("no end marker from the replay socket")
    finally:
        dealer.close()


def replay_endpoint_of(cluster: Cluster, events_address: str) -> str:
    config = (cluster.log_path.parent / "cluster.yaml").read_text()
    replay_base = int(config.split('replay_zmq: "tcp://127.0.0.1:')[1].split('"')[0])
    events_base = int(config.split('zmq: "tcp://127.0.0.1:')[1].split('"')[0])
    offset = int(events_address.rsplit(":", 1)[1]) - events_base
    return f"tcp://127.0.0.1:{replay_base + offset}"


def metrics(cluster: Cluster) -> dict[str, dict]:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    families: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.labels.get("worker"), sample.labels.get("role"))
            families.setdefault(sample.name, {})[key] = sample.value
    return families


def test_metrics_scrape_has_every_family_with_sane_values(cluster) -> None:
    complete(cluster, "Metrics, " + LONG_PREFIX)
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=60, max_retries=0)
    list(client.completions.create(model=MODEL, prompt="Stream me", max_tokens=6, stream=True))
    cluster.wait_idle()
    scrape = metrics(cluster)
    requests = scrape["pdcluster_requests_total"]
    assert sum(v for v in requests.values()) >= 2
    for name in (
        "pdcluster_time_to_first_token_seconds_count",
        "pdcluster_e2e_request_latency_seconds_count",
        "pdcluster_inter_token_latency_seconds_count",
        "pdcluster_prompt_tokens_total",
        "pdcluster_generation_tokens_total",
    ):
        assert sum(scrape[name].values()) >= 1, name
    gens = [("gen-0", "generation"), ("gen-1", "generation")]
    engines = [*gens, ("ctx-0", "context")]
    for worker in engines:
        assert scrape["pdcluster_worker_up"][worker] == 1.0
        assert scrape["pdcluster_kv_blocks_total"][worker] == 512
        assert scrape["pdcluster_kv_blocks_used"][worker] == 0
        assert scrape["pdcluster_kv_blocks_leased"][worker] == 0
        assert 0.0 <= scrape["pdcluster_prefix_cache_hit_rate"][worker] <= 1.0
        assert scrape["pdcluster_num_requests_running"][worker] == 0
        assert scrape["pdcluster_num_requests_waiting"][worker] == 0
    assert scrape["pdcluster_prefill_tokens_total"][("ctx-0", "context")] > 0
    assert scrape["pdcluster_request_queue_time_seconds_count"][("ctx-0", "context")] >= 2
    assert scrape["pdcluster_request_queue_time_seconds_sum"][("ctx-0", "context")] >= 0
    assert sum(scrape["pdcluster_decode_tokens_total"][w] for w in gens) > 0
    assert sum(scrape["pdcluster_nixl_transfer_bytes_total"][w] for w in gens) > 0
    assert sum(scrape["pdcluster_nixl_transfer_seconds_total"][w] for w in gens) > 0
    assert sum(scrape["pdcluster_nixl_transfer_failures_total"][w] for w in gens) == 0
    assert set(scrape["pdcluster_postproc_queue_depth"]) == {
        ("pp-0", "postproc"),
        ("pp-1", "postproc"),
    }
    # the orchestrator's averages, over the prompts ctx-0 prefilled and handed off
    cluster_wide = (None, None)
    assert scrape["pdcluster_first_token_wait_average_seconds"][cluster_wide] > 0
    assert scrape["pdcluster_decode_average_seconds"][cluster_wide] > 0
    assert scrape["pdcluster_context_bound"][cluster_wide] in (0.0, 1.0)


def test_profile_routes_write_every_engine_workers_trace_and_op_table(
    cluster: Cluster, profile_dir: Path
) -> None:
    engines = {"ctx-0", "gen-0", "gen-1"}
    pids = {w.worker_id: w.pid for w in cluster.info().workers}
    with httpx.Client(base_url=cluster.url, timeout=90) as http:
        stop_before = http.post("/stop_profile")
        assert stop_before.status_code == 409, stop_before.text  # nothing is running
        assert "not running" in stop_before.json()["error"]["message"]
        started = http.post("/start_profile")
        assert started.status_code == 200, started.text
        assert set(started.json()["workers"]) == engines and started.json()["errors"] == []
        assert http.post("/start_profile").status_code == 409  # already running everywhere
        for i in range(8):  # over both generation workers, past PROFILED_STEPS on each
            complete(cluster, f"{i} profiled request about the river", max_tokens=16)
        stopped = http.post("/stop_profile")
    assert stopped.status_code == 200, stopped.text
    body = stopped.json()
    assert set(body["workers"]) == engines and body["errors"] == []
    files = [Path(f) for f in body["files"]]
    assert {f.parent for f in files} == {profile_dir}
    assert {f.name.split("-2")[0] for f in files} == engines  # <worker>-<time>.<kind>
    for trace in (f for f in files if f.name.endswith(".pt.trace.json.gz")):
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events), trace
    tables = [f.read_text() for f in files if f.name.endswith(".ops.txt")]
    assert len(tables) == 3 and all("Self CPU" in t and "aten::" in t for t in tables)
    assert {w.worker_id: w.pid for w in cluster.info().workers} == pids  # none was restarted


def test_profile_routes_are_404_when_profiling_is_off(start_cluster) -> None:
    cluster = start_cluster("aggregated")
    with httpx.Client(base_url=cluster.url, timeout=10) as http:
        response = http.post("/start_profile")
    assert response.status_code == 404
    assert "profiler.dir" in response.json()["error"]["message"]


def test_server_info_describes_the_deployment(cluster: Cluster) -> None:
    info = httpx.get(f"{cluster.url}/server_info", timeout=10).json()
    assert info["model"] == MODEL and info["mode"] == "disaggregated"
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["kv_cache"]["block_size"] == 16  # the harness's
    assert info["kv_cache"]["hash_algorithm"].startswith("blake2b-64 chained")
    assert info["protocol_version"] == PROTOCOL_VERSION and info["version"]
    assert info["roles"] == {
        "orchestrator": ["orchestrator"],
        "context": ["ctx-0"],
        "generation": ["gen-0", "gen-1"],
        "postproc": ["pp-0", "pp-1"],
        "frontend": ["fe-0"],
    }
    assert set(info["endpoints"]) == set(ROUTES) and "/server_info" in info["endpoints"]
