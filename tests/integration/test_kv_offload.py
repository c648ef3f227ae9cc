"""`kv_cache.offload` through a real disaggregated cluster: a multi-turn workload whose working set
is 4x each worker's pool (bench/kv_offload.py) gives the same greedy tokens with the tier as
without it and as one engine in process whose pool holds everything, computes fewer prompt
tokens, and leaves no block used or leased, nor a disk tier file once the cluster stopped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.kv_offload import (
    Workload,
    block_num_bytes,
    offload_yaml,
    run_multi_turn,
    summarize,
    wait_idle_info,
)
from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.integration.harness import MODEL, Cluster, stop

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
