"""Where an engine worker's compute threads run on a CPU host (`device: cpu`).

A decode step is a chain of small matmuls: torch threads beyond the cores that are free make
every step slower (threads wait for each other at each op), and an engine whose cores the
frontend, orchestrator and postproc workers also run on loses its slices to them. So each engine
gets its own cores and a thread per core: by default the host's usable cores less one (kept for
the light processes), shared out among the host's engines, at least one each; engine k takes its
share counted from the last core, so core 0 is the one left to the rest. vLLM's CPU backend
places its one compute thread the same way (pinned, the other core for its scheduler).

Which engines share a host: on a loopback `internal_host` every worker of the cluster does; on
any other address each engine worker is a pod (or a host) of its own.
"""

from __future__ import annotations

import logging
import os

import torch

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


def place_engine(config: ClusterConfig, worker_id: str) -> None:
    """Pin this process to its cores (when `cpu.pin`) and size torch's thread pool to them.
    Call before the engine runs its first op: the pool's threads inherit the affinity."""
    if config.device != "cpu":
        return
    usable = sorted(os.sched_getaffinity(0))
    cores = engine_cores(config, worker_id, usable)
    if config.cpu.pin:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    logger.info("%s: %d torch thread(s)%s", worker_id, len(cores),
                f" pinned to cores {cores}" if config.cpu.pin else "")  # fmt: skip
