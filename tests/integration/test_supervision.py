"""`orchestrator up` keeps the cluster alive: a killed worker is restarted and serves again, and
`orchestrator status` reports the same table as GET /cluster_info."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai

from launcher.run_records import running_clusters
from tests.integration.harness import MODEL, Cluster
from tools.tiny_model.build import TEST_PROMPTS

RECOVERY_TIMEOUT_S = 60.0


def ready_pid(cluster: Cluster, worker_id: str) -> int | None:
    rows = [w for w in cluster.info().workers if w.worker_id == worker_id and w.state == "ready"]
    return rows[0].pid if rows else None


def test_killed_generation_worker_is_restarted_and_serves_again(start_cluster) -> None:
    cluster = start_cluster("disaggregated")
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=60, max_retries=0)
    before = client.completions.create(
        model=MODEL, prompt=TEST_PROMPTS[0], max_tokens=8, temperature=0
    )
    old_pid = ready_pid(cluster, "gen-0")
    assert old_pid is not None

    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while (pid := ready_pid(cluster, "gen-0")) in (None, old_pid):
        assert time.monotonic() < deadline, f"gen-0 not back:\n{cluster.log_tail()}"
        time.sleep(0.5)

    after = client.completions.create(
        model=MODEL, prompt=TEST_PROMPTS[0], max_tokens=8, temperature=0
    )
    assert after.choices[0].text == before.choices[0].text
    generation = [w for w in cluster.wait_idle().workers if w.worker_id == "gen-0"]
    assert generation[0].pid == pid and generation[0].kv_bytes_pulled > 0  # NIXL re-peered


def test_status_and_probe_commands(start_cluster) -> None:
    cluster = start_cluster("aggregated")
    config_path = cluster.log_path.parent / "cluster.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "status", str(config_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    served = cluster.info()
    assert [(w["role"], w["worker_id"], w["pid"]) for w in printed["workers"]] == [
        (w.role, w.worker_id, w.pid) for w in served.workers
    ]
    assert {"active_requests", "blocks_used", "blocks_total"} <= set(printed["workers"][0])
    probe = [sys.executable, "-m", "orchestrator.cli", "probe"]
    ready = subprocess.run([*probe, "gen-0", str(config_path)], capture_output=True, timeout=30)
    assert ready.returncode == 0, ready.stderr
    missing = subprocess.run([*probe, "gen-9", str(config_path)], capture_output=True, timeout=30)
    assert missing.returncode == 1 and b"gen-9" in missing.stderr
    # what `orchestrator status` without a file reads: the supervisor's record of this cluster
    (running,) = [r for r in running_clusters() if r.pid == cluster.process.pid]
    assert running.config_path == str(config_path) and running.url == cluster.url
