"""`kv_cache.offload` through a real disaggregated cluster: a multi-turn workload whose working set
is 4x each worker's pool (bench/kv_offload.py) gives the same greedy tokens with the tier as
without it and as one engine in process whose pool holds everything, computes fewer prompt
tokens, and leaves no block used or leased, nor a disk tier file once the cluster stopped."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from bench.kv_offload import (
    TOKEN_RANGE,
    Workload,
    block_num_bytes,
    offload_yaml,
    run_multi_turn,
    stream_completion,
    summarize,
    wait_idle_info,
)
from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.integration.harness import MODEL, Cluster, stop
from tests.integration.test_observability import metrics

pytestmark = pytest.mark.long

WORKLOAD = Workload(conversations=8, turns=4, turn_tokens=48, max_tokens=16, num_blocks=32)


def in_process_answers(workload: Workload, prompts_of: list[list[int]]) -> list[list[int]]:
    llm = LLM(MODEL, block_size=16, num_blocks=1024)
    greedy = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts_of, greedy)]


def test_multi_turn_through_a_cluster_with_the_tier_matches_and_computes_less(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    assert WORKLOAD.working_set_blocks >= 4 * WORKLOAD.num_blocks
    host_bytes = 64 * block_num_bytes(MODEL)  # half the working set; the disk tier the rest
    settings = {
        "off": offload_yaml(WORKLOAD, 0),
        "host+disk": offload_yaml(WORKLOAD, host_bytes, str(tmp_path / "kv-disk")),
    }
    runs, figures = {}, {}
    for name, kv_cache in settings.items():
        cluster = start_cluster("disaggregated", kv_cache=kv_cache)
        runs[name] = run_multi_turn(cluster.url, MODEL, WORKLOAD)
        figures[name] = summarize(runs[name], wait_idle_info(cluster.url))
        assert figures[name]["blocks_used_after"] == 0, figures[name]
        assert figures[name]["blocks_leased_after"] == 0, figures[name]
        if name == "host+disk":
            assert list((tmp_path / "kv-disk").iterdir()), "no worker made a disk tier"
            stop(cluster, [w.pid for w in cluster.info().workers])
            assert list((tmp_path / "kv-disk").iterdir()) == []  # each worker removed its own
    assert runs["host+disk"].answers == runs["off"].answers
    assert in_process_answers(WORKLOAD, runs["off"].prompts) == runs["off"].answers
    computed = {name: f["prompt_tokens_computed"] for name, f in figures.items()}
    assert computed["host+disk"] < 0.6 * computed["off"], figures  # type: ignore[operator]


PEERS = Workload(conversations=7, turns=3, turn_tokens=48, max_tokens=16, num_blocks=32)
TWO_CONTEXT_WORKERS = "context_workers: {count: 2}\n"


def test_context_workers_read_each_others_host_tiers(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Round robin over two context workers and 7 conversations: each conversation's turns
    alternate between them, so a turn's history was last computed on the other worker, and
    reaches this one from that worker's host tier over NIXL."""
    cluster = start_cluster(
        "disaggregated",
        extra=TWO_CONTEXT_WORKERS,
        kv_cache=offload_yaml(PEERS, 128 * block_num_bytes(MODEL)),
        orchestrator="router: round_robin, worker_timeout_seconds: 5",
    )
    run = run_multi_turn(cluster.url, MODEL, PEERS)
    figures = summarize(run, wait_idle_info(cluster.url))
    assert figures["blocks_used_after"] == 0 and figures["blocks_leased_after"] == 0, figures
    assert in_process_answers(PEERS, run.prompts) == run.answers
    reads = [
        int(line.split(": ")[-1].split()[0])
        for line in cluster.log_tail(None).splitlines()
        if "prompt blocks read from" in line
    ]
    assert sum(reads) > 0, "no context worker read a peer's host tier"
    cluster.wait_idle()  # every worker's stats from after the last request
    scrape = metrics(cluster)
    assert sum(scrape["pdcluster_kv_offload_peer_blocks_read_total"].values()) == sum(reads)
    assert sum(scrape["pdcluster_kv_offload_stored_blocks_total"].values()) > 0
    assert sum(scrape["pdcluster_kv_offload_restored_blocks_total"].values()) >= sum(reads)
    assert sum(scrape["pdcluster_kv_offload_host_blocks"].values()) > 0


def test_a_peer_killed_while_its_tier_is_read_leaves_the_reader_to_recompute(
    start_cluster: Callable[..., Cluster],
) -> None:
    """ctx S prefills prompt P, then a filler pushes P out of S's pool into its host tier. S is
    SIGKILLed; the next request, P continued, goes (round robin) to the other worker R with S's
    tier named as holding P: R's READ fails, R computes P itself, and the tokens are right."""
    block_bytes = block_num_bytes(MODEL)
    cluster = start_cluster(
        "disaggregated",
        extra=TWO_CONTEXT_WORKERS,
        kv_cache=f"num_blocks: 16, offload: {{host_bytes: {64 * block_bytes}}}",
        orchestrator="router: round_robin, worker_timeout_seconds: 5",
    )
    rng = random.Random(1)
    prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(80)]  # 5 blocks
    # a filler's 250 tokens take all 16 blocks of a pool: every block of P leaves it
    fillers = [[rng.randrange(*TOKEN_RANGE) for _ in range(250)] for _ in range(2)]
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        routed = {w.worker_id: w.requests_routed for w in cluster.workers("context")}
        stream_completion(client, MODEL, prompt, 4)
        after = {w.worker_id: w.requests_routed for w in cluster.workers("context")}
        [source] = [w for w in after if after[w] > routed[w]]
        for filler in fillers:  # the other worker, then the source: P leaves its pool
            stream_completion(client, MODEL, filler, 4)
        wait_idle_info(cluster.url)  # the source's tier events have reached the orchestrator
        [victim] = [w for w in cluster.workers("context") if w.worker_id == source]
        os.kill(victim.pid, signal.SIGKILL)
        continued = prompt + [rng.randrange(*TOKEN_RANGE) for _ in range(20)]
        _, tokens = stream_completion(client, MODEL, continued, 8)
    log = cluster.log_tail(None)
    assert "host tier READ from" in log, "the reader never tried the killed worker's tier"
    expected = in_process_answers(Workload(max_tokens=8), [continued])
    assert [tokens] == expected
