"""Keeping the cluster's children alive: restarts with a doubling backoff, and scaling.

A crashed child is started again after its backoff (1 s doubling to 30 s by default; a child that
ran a good while counts afresh). A worker that exits 0 drained on purpose (scaled down,
`orchestrator drain`) is removed, and one that exits EXIT_REFUSED (duplicate id, protocol
version, bad arguments) is left down: it would only fail the same way again.

`orchestrator scale ROLE=N` reaches `scale`: new workers get the lowest free index, and the
highest-numbered ones are sent SIGTERM, which drains them (common/entrypoint.py).
"""

from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.worker_link import EXIT_REFUSED
from launcher.processes import describe_exit, signal_group, start_process, stop_processes
from launcher.specs import WORKER_MODULES, ProcessSpec, worker_index

logger = logging.getLogger(__name__)

RETIRE_MARGIN_S = 10.0  # past its drain timeout, a retiring worker is killed after this long


@dataclass(slots=True)
class Child:
    """A supervised process: the current one (None while waiting to restart) and its history."""

    spec: ProcessSpec
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff_s: float = 0.0  # delay before the next restart; doubles per crash, capped
    restart_at: float | None = None  # monotonic time a crashed child is due to start again
    num_restarts: int = 0
    gave_up: bool = False  # exited with EXIT_REFUSED: left down on purpose
    retire_by: float | None = None  # scaled down: draining, killed if still running by then


class Supervisor:
    """Starts the children, restarts the ones that crash, and stops them all leaving none behind."""

    def __init__(
        self,
        specs: list[ProcessSpec],
        *,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.children = [Child(spec, backoff_s=backoff_initial_s) for spec in specs]
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s

    def start(self) -> None:
        for child in self.children:
            self._start(child)

    def _start(self, child: Child) -> None:
        child.process = start_process(child.spec)
        child.started_at = time.monotonic()

    def exited(self) -> list[Child]:
        """Children whose process has ended (during start-up every exit is fatal)."""
        return [c for c in self.children if c.process is not None and c.process.poll() is not None]

    def poll(self) -> None:
        """Notice crashed children and start the ones whose backoff has elapsed."""
        now = time.monotonic()
        for child in self.exited():
            self._on_exit(child, now)
        for child in self.children:
            if child.retire_by is not None and now > child.retire_by and child.process:
                logger.warning("%s did not drain in time: killing it", child.spec.worker_id)
                signal_group(child.process, signal.SIGKILL)
        for child in self.children:
            if child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                child.num_restarts += 1
                self._start(child)

    def _on_exit(self, child: Child, now: float) -> None:
        assert child.process is not None
        process, child.process = child.process, None
        what = f"{child.spec.worker_id} (pid {process.pid}) {describe_exit(process)}"
        drained = process.returncode == 0 and child.spec.role in WORKER_MODULES
        if child.retire_by is not None or drained:
            self.children.remove(child)  # drained on purpose: the cluster is smaller now
            logger.info("%s: drained, removed (not restarted)", what)
            return
        # Refused (duplicate id, protocol version) or misconfigured (argparse): it would only fail
        # the same way again.
        if process.returncode == EXIT_REFUSED:
            child.gave_up = True
            logger.error("%s: refused or misconfigured, not restarting it (see its output)", what)
            return
        uptime_s = now - child.started_at
        if uptime_s >= self.backoff_max_s:
            child.backoff_s = self.backoff_initial_s  # it ran a good while: count afresh
        logger.warning("%s after %.1fs; restarting it in %.0fs", what, uptime_s, child.backoff_s)
        child.restart_at = now + child.backoff_s
        child.backoff_s = min(child.backoff_s * 2, self.backoff_max_s)

    def scale(
        self, role: str, count: int, make_spec: Callable[[int], ProcessSpec], drain_s: float
    ) -> None:
        """Run `count` workers of `role`: start new ones at the lowest free indexes, or drain
        (SIGTERM) the highest-numbered ones, which leave by themselves within `drain_s`."""
        serving = sorted(
            (c for c in self.children if c.spec.role == role and c.retire_by is None),
            key=lambda c: worker_index(c.spec.worker_id),
        )
        for child in serving[count:]:
            logger.info("scaling %s down: draining %s", role, child.spec.worker_id)
            child.retire_by = time.monotonic() + drain_s + RETIRE_MARGIN_S
            child.restart_at = None
            if child.process is None:
                self.children.remove(child)
            else:
                signal_group(child.process, signal.SIGTERM)
        taken = {worker_index(c.spec.worker_id) for c in self.children if c.spec.role == role}
        free = (i for i in itertools.count() if i not in taken)
        for index in itertools.islice(free, max(0, count - len(serving))):
            child = Child(make_spec(index), backoff_s=self.backoff_initial_s)
            self.children.append(child)
            logger.info("scaling %s up: starting %s", role, child.spec.worker_id)
            self._start(child)

    def stop(self, timeout_s: float = 8.0) -> None:
        """SIGINT every child's process group (stop now, no drain), wait up to `timeout_s` in
        all, SIGKILL the rest; none is restarted after."""
        for child in self.children:
            child.restart_at = None
        running = [(c.spec.worker_id, c.process) for c in self.children if c.process is not None]
        stop_processes(running, timeout_s)
