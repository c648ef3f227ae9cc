"""Fixtures that start real clusters (see harness.py); every one is stopped after its module."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.harness import MODEL, Cluster, stop, wait_healthy, write_config


@pytest.fixture(scope="module")
def start_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> Iterator[Callable[..., Cluster]]:
    """A factory: start_cluster(mode, extra=, frontend=, api_key=, kv_cache=, model=) -> Cluster
    (the strings are YAML keys to add); every cluster is stopped after the module."""
    started: list[tuple[Cluster, list[int]]] = []

    def start(
        mode: str,
        extra: str = "",
        frontend: str = "",
        api_key: str | None = None,
        kv_cache: str = "",
        orchestrator: str | None = None,
        model: str = MODEL,
    ) -> Cluster:
        tmp = tmp_path_factory.mktemp(f"cluster-{mode}")
        if api_key:
            frontend = ", ".join(filter(None, [frontend, f"api_key: {api_key}"]))
        options = {"orchestrator": orchestrator} if orchestrator else {}
        options["model"] = model
        config_path, port = write_config(
            tmp / "cluster.yaml", mode, extra, frontend, kv_cache, **options
        )
        log_path = tmp / "cluster.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.cli", "up", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        cluster = Cluster(f"http://127.0.0.1:{port}", process, log_path, api_key)
        started.append((cluster, []))
        wait_healthy(cluster)
        started[-1] = (cluster, [w.pid for w in cluster.info().workers])
        return cluster

    yield start
    for cluster, pids in started:
        stop(cluster, pids)
