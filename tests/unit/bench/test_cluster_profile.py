"""bench/cluster_profile.py: per-process CPU and py-spy's hottest functions, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.cluster_profile import ClusterProfile, cluster_processes, hot_functions

SUPERVISOR = """
import subprocess, sys, time
children = [subprocess.Popen([sys.executable, sys.argv[1], "--worker-id", name])
            for name in ("busy-0", "idle-0")]
time.sleep(60)
"""

WORKER = """
import sys, time

def hash_rounds():
    x = 0
    for i in range(20000):
        x = (x * 31 + i) % 1000003

def sort_rounds():
    sorted(range(20000, 0, -1), key=lambda v: v % 97)

if sys.argv[2] == "idle-0":
    time.sleep(60)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    hash_rounds()
    sort_rounds()
"""


def test_hot_functions_ranks_project_frames_inclusive_and_any_frame_by_self() -> None:
    raw = "\n".join([
        "main (generation_worker/main.py:9);step (engine/llm_engine.py:3);mm (torch/x.py:1) 60",
        "main (generation_worker/main.py:9);step (engine/llm_engine.py:4);sm (torch/y.py:2) 30",
        "main (generation_worker/main.py:9);poll (zmq/poll.py:7) 10",
    ])  # fmt: skip
    hot = hot_functions(raw)
    assert hot["samples"] == 100
    # main is in every sample (says nothing); torch's frames are not this project's
    assert hot["inclusive"] == {"step (engine/llm_engine.py)": 0.9}
    assert hot["self"] == {"mm (torch/x.py)": 0.6, "sm (torch/y.py)": 0.3,
                           "poll (zmq/poll.py)": 0.1}  # fmt: skip
    assert hot_functions("") == {"samples": 0}


def test_hot_functions_names_the_deepest_frame_of_a_process_busy_in_one_call() -> None:
    """Every sample inside one engine call (the C decode step): the loop's frames above it say
    nothing, but the call itself is where the time goes and must be listed."""
    loop = "main (generation_worker/main.py:9);step (generation_worker/worker.py:5)"
    raw = "\n".join([
        f"{loop};step (engine/llm_engine.py:3);decode (engine/cpu_step.py:8);c (cpu.so) 98",
        f"{loop};step (engine/llm_engine.py:3);emit (engine/out.py:2) 1",
        f"{loop};poll (common/link.py:7) 1",
    ])  # fmt: skip
    hot = hot_functions(raw)
    assert hot["inclusive"] == {"decode (engine/cpu_step.py)": 0.98, "emit (engine/out.py)": 0.01,
                                "poll (common/link.py)": 0.01}  # fmt: skip


def test_profile_measures_every_child_of_the_supervisor(tmp_path: Path) -> None:
    (tmp_path / "supervisor.py").write_text(SUPERVISOR)
    (tmp_path / "worker.py").write_text(WORKER)
    supervisor = subprocess.Popen(
        [sys.executable, str(tmp_path / "supervisor.py"), str(tmp_path / "worker.py")],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while len(cluster_processes(supervisor.pid)) < 2:
            assert time.monotonic() < deadline, "the supervisor's children did not start"
            time.sleep(0.1)
        with ClusterProfile(supervisor.pid, tmp_path / "raw") as profile:
            time.sleep(3)
        summary = profile.summary()
    finally:
        os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait(10)
    # a share of the cores, not a fixed one: on a loaded 2-core host the busy loop gets what
    # the others leave it (0.39 seen), the idle one next to nothing
    busy, idle = summary["busy-0"]["cpu_cores"], summary["idle-0"]["cpu_cores"]
    assert idle < 0.1 and busy > max(0.05, 10 * idle)
    assert summary["busy-0"]["samples"] > 50
    spent = summary["busy-0"]["self"]
    loop = {"hash_rounds (worker.py)", "sort_rounds (worker.py)"}
    assert loop <= set(spent) and all(spent[name] > 0.1 for name in loop)
    assert sum(spent.values()) > 0.9  # with the sort key and the loop itself
    assert (tmp_path / "raw" / "busy-0.txt").exists()
