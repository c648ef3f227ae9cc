"""Which cores each process of a CPU host (`device: cpu`) runs on.

A decode step is a chain of small matmuls: torch threads beyond the cores that are free make
every step slower (threads wait for each other at each op), and an engine whose cores the
frontend, orchestrator and postproc workers also run on loses its slices to them. So each engine
gets its own cores and a thread per core: by default the host's usable cores less one (kept for
the light processes), shared out among the host's engines, at least one each; engine k takes its
share counted from the last core, so core 0 is the one left to the rest. vLLM's CPU backend
places its one compute thread the same way (pinned, the other core for its scheduler). The
frontend, orchestrator and postproc workers of the host are pinned to the cores no engine has,
so that they never take an engine's core from it.

Which engines share a host: on a loopback `internal_host` every worker of the cluster does; on
any other address each engine worker is a pod (or a host) of its own.
"""

from __future__ import annotations

import logging
import os

from common.config import ClusterConfig

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def engines_on_host(config: ClusterConfig) -> int:
    if config.internal_host not in LOOPBACK:
        return 1
    count = config.generation_workers.count
    if config.mode == "disaggregated":
        count += config.context_workers.count
    return count


def engine_index(config: ClusterConfig, worker_id: str) -> int:
    """This engine's position among the host's engines: generation workers first, then context
    workers, by the index in their ids (gen-0, gen-1, ..., ctx-0, ...)."""
    if config.internal_host not in LOOPBACK:
        return 0
    role, _, index = worker_id.rpartition("-")
    position = int(index) if index.isdigit() else 0
    return position + (config.generation_workers.count if role == "ctx" else 0)


def engine_cores(config: ClusterConfig, worker_id: str, usable: list[int]) -> list[int]:
    """The cores of one engine worker: `cpu.threads_per_engine` of them (0: the usable cores
    less one, shared out), counted from the last usable core, wrapping around when the host has
    fewer cores than its engines ask for."""
    num_engines = engines_on_host(config)
    threads = config.cpu.threads_per_engine or max(1, (len(usable) - 1) // num_engines)
    first = engine_index(config, worker_id) * threads
    ordered = usable[::-1]
    return sorted({ordered[(first + i) % len(ordered)] for i in range(threads)})


def place_engine(config: ClusterConfig, worker_id: str) -> int:
    """Pin this engine worker to its cores (when `cpu.pin`); returns how many torch threads it
    should run (one per core). Call before the engine's first op: the pool's threads inherit
    the affinity."""
    cores = engine_cores(config, worker_id, sorted(os.sched_getaffinity(0)))
    if config.cpu.pin:
        os.sched_setaffinity(0, cores)
    logger.info("%s: %d torch thread(s)%s", worker_id, len(cores),
                f" pinned to cores {cores}" if config.cpu.pin else "")  # fmt: skip
    return len(cores)


def light_cores(config: ClusterConfig, usable: list[int]) -> list[int]:
    """The cores no engine of the host has (all of them when the engines have every core)."""
    taken = {
        core
        for worker_id in _host_engine_ids(config)
        for core in engine_cores(config, worker_id, usable)
    }
    return [core for core in usable if core not in taken] or usable


def place_light_process(config: ClusterConfig) -> None:
    """Pin a frontend, orchestrator or postproc process to the cores the host's engines leave
    free, when everything shares a host (loopback) on a CPU cluster."""
    if config.device != "cpu" or not config.cpu.pin or config.internal_host not in LOOPBACK:
        return
    os.sched_setaffinity(0, light_cores(config, sorted(os.sched_getaffinity(0))))


def _host_engine_ids(config: ClusterConfig) -> list[str]:
    ids = [f"gen-{i}" for i in range(config.generation_workers.count)]
    if config.mode == "disaggregated":
        ids += [f"ctx-{i}" for i in range(config.context_workers.count)]
    return ids
