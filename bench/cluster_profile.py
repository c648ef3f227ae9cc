"""Where a cluster's CPU time goes during one benchmark run: each process's CPU use (from /proc)
and, where py-spy can attach, its hottest functions. Linux only.

    with ClusterProfile(supervisor_pid, raw_dir) as profile:
        ...  # the load
    summary = profile.summary()  # {process: {cpu_cores, samples, inclusive, self}}

py-spy samples without pausing the processes (--nonblocking), so the run it watches is slowed
little, but the benchmark still leaves that run out of its medians.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_RATE_HZ = 100
TOP_FUNCTIONS = 12
# Frames in nearly every sample (the module runner, main(), the worker loop) say nothing, except
# the deepest of them: a process that spends all its time in one engine call must still name it.
EVERYWHERE = 0.97
# `inclusive` lists this project's functions only: torch's and asyncio's plumbing frames sit
# above every leaf and would crowd them out.
OWN_PACKAGES = ("common/", "engine/", "frontend/", "orchestrator/", "context_worker/",
                "generation_worker/", "postproc_worker/")  # fmt: skip


@dataclass(slots=True)
class WatchedProcess:
    name: str
    pid: int
    cpu_start_s: float
    raw_path: Path
    cpu_s: float = 0.0
    sampler: subprocess.Popen | None = None


@dataclass(slots=True)
class ClusterProfile:
    supervisor_pid: int
    raw_dir: Path
    processes: list[WatchedProcess] = field(default_factory=list)
    wall_start_s: float = 0.0
    wall_s: float = 0.0
    client_cpu_s: float = 0.0
    py_spy: str | None = None

    def __enter__(self) -> ClusterProfile:
        self.raw_dir.mkdir(parents=True, exist_ok=True)
        self.py_spy = shutil.which("py-spy") or _beside_python("py-spy")
        for name, pid in cluster_processes(self.supervisor_pid).items():
            watched = WatchedProcess(name, pid, cpu_seconds(pid), self.raw_dir / f"{name}.txt")
            if self.py_spy:
                watched.sampler = subprocess.Popen(
                    [self.py_spy, "record", "--pid", str(pid), "--rate", str(SAMPLE_RATE_HZ),
                     "--format", "raw", "--nonblocking", "--output", str(watched.raw_path)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            self.processes.append(watched)
        self.client_cpu_s = time.process_time()
        self.wall_start_s = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.wall_start_s
        self.client_cpu_s = time.process_time() - self.client_cpu_s
        for watched in self.processes:
            watched.cpu_s = max(0.0, cpu_seconds(watched.pid) - watched.cpu_start_s)
            if watched.sampler is not None:
                watched.sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for watched in self.processes:
            if watched.sampler is not None:
                try:
                    watched.sampler.wait(30)
                except subprocess.TimeoutExpired:
                    watched.sampler.kill()
                    watched.sampler.wait(5)

    def summary(self) -> dict:
        """Per process: the cores it kept busy, and its hottest functions as shares of its
        samples; `client` is the benchmark's own HTTP load (this process)."""
        client = {"cpu_cores": round(self.client_cpu_s / self.wall_s, 3)}
        out: dict = {"wall_s": round(self.wall_s, 2), "client": client}
        for watched in self.processes:
            entry: dict = {"cpu_cores": round(watched.cpu_s / self.wall_s, 3)}
            if watched.raw_path.exists():
                entry.update(hot_functions(watched.raw_path.read_text()))
            out[watched.name] = entry
        return out


def cluster_processes(supervisor_pid: int) -> dict[str, int]:
    """The supervisor's children by role and worker id (`gen-0`, `ctx-0`, `orchestrator`...)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # gone meanwhile
        if int(stat.rpartition(")")[2].split()[1]) != supervisor_pid:
            continue
        if "--worker-id" in args:
            found[args[args.index("--worker-id") + 1]] = int(entry.name)
        elif "-m" in args:
            found[args[args.index("-m") + 1].split(".")[0]] = int(entry.name)
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hot_functions(raw: str) -> dict:
    """From py-spy's raw output (one `frame;frame;... count` line per stack): the functions that
    take the most samples including their callees (`inclusive`, this project's functions) and
    in themselves (`self`, any function)."""
    stacks: list[tuple[list[str], int]] = []
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_function(frame) for frame in stack.split(";")]
        stacks.append((frames, int(count)))
        for name in set(frames):
            if _is_own(name):
                inclusive[name] += int(count)
        own[frames[-1]] += int(count)
    total = sum(count for _, count in stacks)
    if not total:
        return {"samples": 0}
    kept = _busy_in_one_call(stacks, {n for n, c in inclusive.items() if c / total >= EVERYWHERE})

    def shares(counter: Counter[str]) -> dict[str, float]:
        ranked = [(n, c / total) for n, c in counter.most_common()
                  if c / total < EVERYWHERE or n == kept]  # fmt: skip
        return {n: round(s, 3) for n, s in ranked[:TOP_FUNCTIONS]}

    return {"samples": total, "inclusive": shares(inclusive), "self": shares(own)}


def _busy_in_one_call(stacks: list[tuple[list[str], int]], everywhere: set[str]) -> str | None:
    """The deepest of this project's frames found in nearly every sample, when none of this
    project's frames is ever below it: then the process spends its time in that one call (the C
    decode step, a torch forward) and the call is the answer, not plumbing."""
    commonest, _ = max(stacks, key=lambda stack: stack[1])
    chain = [name for name in commonest if name in everywhere]
    deepest = chain[-1] if chain else None
    if deepest is None:
        return None
    for frames, _ in stacks:
        if deepest in frames and any(map(_is_own, frames[frames.index(deepest) + 1 :])):
            return None
    return deepest


def _is_own(name: str) -> bool:
    return name.partition(" (")[2].startswith(OWN_PACKAGES)


def _function(frame: str) -> str:
    """`step (generation_worker/worker.py:113)` -> `step (generation_worker/worker.py)`: the
    line number would split one function into many."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rpartition(':')[0]})" if where else name


def _beside_python(tool: str) -> str | None:
    """The venv's copy when the venv is not on PATH (bench scripts run as .venv/bin/python)."""
    path = Path(sys.executable).with_name(tool)
    return str(path) if path.exists() else None
