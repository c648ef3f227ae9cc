"""The process table: every process of a cluster as a command line, orchestrator first."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from common.config import ClusterConfig
from common.curve import KEYS_ENV

WORKER_PREFIXES = {"context": "ctx", "generation": "gen", "postproc": "pp"}
WORKER_MODULES = {
    "context": "context_worker.main",
    "generation": "generation_worker.main",
    "postproc": "postproc_worker.main",
}


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One process of the cluster: its name in ClusterInfo and the command that starts it."""

    worker_id: str
    role: str  # orchestrator | context | generation | postproc | frontend
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # set on top of the supervisor's environment


def process_specs(
    config: ClusterConfig,
    config_path: str | None,
    metrics_dir: str | None = None,
    keys_dir: str | None = None,
) -> list[ProcessSpec]:
    """Every process `orchestrator up` starts, orchestrator first (the others register with it).
    The frontends share `metrics_dir`, prometheus_client's multiprocess directory; every process
    gets the cluster's CURVE keys directory."""
    orchestrator = _spec("orchestrator", "orchestrator", "orchestrator.main", config_path,
                         keys_dir, named=False)  # fmt: skip
    specs = [orchestrator]
    counts = {
        "context": config.context_workers.count if config.mode == "disaggregated" else 0,
        "generation": config.generation_workers.count,
        "postproc": config.postproc_workers.count,
    }
    for role, count in counts.items():
        specs.extend(worker_spec(role, i, config_path=config_path, keys_dir=keys_dir)
                     for i in range(count))  # fmt: skip
    for i in range(config.frontend.processes):
        specs.append(_spec(f"fe-{i}", "frontend", "frontend.main", config_path, keys_dir,
                           metrics_dir=metrics_dir))  # fmt: skip
    return specs


def worker_spec(
    role: str, index: int, config_path: str | None, keys_dir: str | None
) -> ProcessSpec:
    """Worker `index` of a role (context, generation, postproc): `gen-3` for ("generation", 3)."""
    worker_id = f"{WORKER_PREFIXES[role]}-{index}"
    return _spec(worker_id, role, WORKER_MODULES[role], config_path, keys_dir)


def _spec(
    worker_id: str,
    role: str,
    module: str,
    config_path: str | None,
    keys_dir: str | None,
    metrics_dir: str | None = None,
    named: bool = True,
) -> ProcessSpec:
    """`python -m module`, with its id and config, the keys directory in its environment, and
    prometheus_client's multiprocess directory for a frontend."""
    name = ("--worker-id", worker_id) if named else ()
    tail = ("--config", config_path) if config_path else ()
    env: tuple[tuple[str, str], ...] = ((KEYS_ENV, keys_dir),) if keys_dir else ()
    if metrics_dir:
        env += (("PROMETHEUS_MULTIPROC_DIR", metrics_dir),)
    return ProcessSpec(worker_id, role, (sys.executable, "-m", module, *name, *tail), env)


def worker_index(worker_id: str) -> int:
    return int(worker_id.rpartition("-")[2])
