"""Each engine worker's cores: its own, counted from the last core, one core left to the rest."""

from __future__ import annotations

from common.config import parse_cluster_config
from common.cpu_placement import engine_cores, light_cores


def cores(yaml: str, worker_id: str, num_cores: int) -> list[int]:
    return engine_cores(parse_cluster_config(yaml), worker_id, list(range(num_cores)))


def test_two_cores_one_engine_each_core_a_role() -> None:
    assert cores("mode: aggregated", "gen-0", 2) == [1]
    assert cores("mode: disaggregated", "gen-0", 2) == [1]
    assert cores("mode: disaggregated", "ctx-0", 2) == [0]


def test_many_cores_are_shared_out_without_overlap() -> None:
    yaml = "generation_workers: {count: 2}\ncontext_workers: {count: 1}"
    gen0, gen1, ctx0 = (cores(yaml, w, 16) for w in ("gen-0", "gen-1", "ctx-0"))
    assert gen0 == [11, 12, 13, 14, 15] and gen1 == [6, 7, 8, 9, 10] and ctx0 == [1, 2, 3, 4, 5]


def test_an_explicit_thread_count_and_a_host_too_small_for_it() -> None:
    assert cores("cpu: {threads_per_engine: 2}", "gen-0", 8) == [6, 7]
    assert cores("cpu: {threads_per_engine: 2}", "ctx-0", 8) == [4, 5]
    assert cores("cpu: {threads_per_engine: 3}", "ctx-0", 4) == [0, 2, 3]  # wraps around
    assert cores("mode: aggregated", "gen-0", 1) == [0]


def test_a_pod_of_its_own_takes_its_cores_less_one() -> None:
    yaml = "internal_host: 0.0.0.0\ngeneration_workers: {count: 4}"
    assert cores(yaml, "gen-3", 4) == [1, 2, 3]


def test_the_light_processes_keep_off_every_engine_core() -> None:
    two_engines = parse_cluster_config("mode: disaggregated")
    assert light_cores(two_engines, [0, 1]) == [0, 1]  # both cores are engines': share them
    assert light_cores(parse_cluster_config("mode: aggregated"), [0, 1]) == [0]
    yaml = "generation_workers: {count: 2}\ncontext_workers: {count: 1}"
    assert light_cores(parse_cluster_config(yaml), list(range(16))) == [0]
