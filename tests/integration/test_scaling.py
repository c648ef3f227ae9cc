"""`orchestrator scale` on a running cluster under load: workers join and serve, removed ones
drain (their requests finish, their blocks are freed), exit 0 and stay down; no request fails."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest

from tests.integration.harness import MODEL, Cluster

pytestmark = [pytest.mark.long, pytest.mark.timeout(900)]

SCALE_TIMEOUT_S = 240.0
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # several KV blocks: a hand-off


@dataclass
class Load:
    """Client threads sending completions, streamed and not, until stopped."""

    cluster: Cluster
    num_threads: int = 3
    done: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, index: int) -> None:
        client = openai.OpenAI(base_url=self.cluster.base_url, api_key="x", timeout=120,
                               max_retries=0)  # fmt: skip
        stream = index % 2 == 1
        while not self.stop.is_set():
            try:
                if stream:
                    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                                       temperature=0, stream=True)  # fmt: skip
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                else:
                    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                                       temperature=0)  # fmt: skip
                    text = result.choices[0].text
                assert text, "an empty completion"
                with self.lock:
                    self.done += 1
            except Exception as e:  # every failure is the test's to report
                with self.lock:
                    self.errors.append(f"{type(e).__name__}: {e}")


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster(
        "disaggregated", orchestrator="router: round_robin, drain_timeout_seconds: 60"
    )


@pytest.fixture
def load(cluster: Cluster) -> Iterator[Load]:
    load = Load(cluster)
    threads = [threading.Thread(target=load.run, args=(i,)) for i in range(load.num_threads)]
    for thread in threads:
        thread.start()
    yield load
    load.stop.set()
    for thread in threads:
        thread.join(timeout=150)
    assert not any(thread.is_alive() for thread in threads)


def scale(cluster: Cluster, *counts: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "scale", *counts,
         "--config", str(cluster.log_path.parent / "cluster.yaml"),
         "--timeout", str(SCALE_TIMEOUT_S)],
        capture_output=True, text=True, timeout=SCALE_TIMEOUT_S + 30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + cluster.log_tail()


def served(cluster: Cluster, role: str) -> dict[str, int]:
    """Tokens each live worker of `role` sampled (as of its last heartbeat)."""
    return {w.worker_id: w.generation_tokens for w in cluster.workers(role) if w.state != "dead"}


def wait_until_served(cluster: Cluster, load: Load, role: str, worker_ids: list[str],
                      timeout_s: float = 60.0) -> None:  # fmt: skip
    """Until each of `worker_ids` has reported sampled tokens: its heartbeat carries its stats,
    so a worker that served its first requests says so up to a heartbeat later."""
    deadline = time.monotonic() + timeout_s
    while not all(served(cluster, role).get(w, 0) > 0 for w in worker_ids):
        assert time.monotonic() < deadline and not load.errors, (served(cluster, role), load.errors)
        time.sleep(0.2)


def wait_for_load(load: Load, more: int, timeout_s: float = 120.0) -> None:
    target, deadline = load.done + more, time.monotonic() + timeout_s
    while load.done < target and time.monotonic() < deadline and not load.errors:
        time.sleep(0.2)
    assert load.done >= target, (load.done, load.errors)


def drained_exits(cluster: Cluster, worker_id: str, timeout_s: float = 30.0) -> list[str]:
    """How the supervisor saw `worker_id` end after its drain (it left the orchestrator's
    table just before its process exits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.findall(rf"{worker_id} \(pid \d+\) (.*?): drained", cluster.log_tail(None))
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_generation_scales_1_3_1_under_load_without_a_failed_request(
    cluster: Cluster, load: Load
) -> None:
    wait_for_load(load, 3)
    scale(cluster, "generation=3")
    assert sorted(served(cluster, "generation")) == ["gen-0", "gen-1", "gen-2"]
    wait_for_load(load, 12)
    wait_until_served(cluster, load, "generation", ["gen-1", "gen-2"])  # round robin: both serve
    scale(cluster, "generation=1")
    assert list(served(cluster, "generation")) == ["gen-0"]
    for worker_id in ("gen-1", "gen-2"):
        assert drained_exits(cluster, worker_id) == ["exited with code 0"]
    wait_for_load(load, 5)
    time.sleep(2)  # a restart would come after the 1 s backoff
    assert list(served(cluster, "generation")) == ["gen-0"]
    assert not re.search(r"gen-[12] .*restarting it", cluster.log_tail(None))
    assert not load.errors, load.errors


def test_context_scales_1_2_1_under_load_without_a_failed_request(
    cluster: Cluster, load: Load
) -> None:
    wait_for_load(load, 3)
    scale(cluster, "context=2")
    wait_for_load(load, 10)
    wait_until_served(cluster, load, "context", ["ctx-1"])
    scale(cluster, "context=1")
    assert list(served(cluster, "context")) == ["ctx-0"]
    assert drained_exits(cluster, "ctx-1") == ["exited with code 0"]
    wait_for_load(load, 5)
    assert not load.errors, load.errors


def test_drain_command_takes_a_postproc_worker_out_under_load(cluster: Cluster, load: Load) -> None:
    """What a pod's preStop hook runs: the streams it formats finish, then it is gone."""
    wait_for_load(load, 3)
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "drain", "pp-1",
         str(cluster.log_path.parent / "cluster.yaml"), "--timeout", "60"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + cluster.log_tail()
    assert [w.worker_id for w in cluster.workers("postproc")] == ["pp-0"]
    assert drained_exits(cluster, "pp-1") == ["exited with code 0"]
    wait_for_load(load, 5)
    assert not load.errors, load.errors


def test_nothing_is_left_held_after_scaling(cluster: Cluster) -> None:
    info = cluster.wait_idle(timeout_s=20)
    engines = [w for w in info.workers if w.role in ("context", "generation")]
    assert sorted(w.worker_id for w in engines) == ["ctx-0", "gen-0"]
    for worker in engines:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker
        assert worker.active_requests == 0, worker
    assert info.num_requests == 0
