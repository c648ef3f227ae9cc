"""`orchestrator up`: start every process of the cluster, wait until it serves, keep it alive.

The supervisor is a plain synchronous loop over child processes (no torch, no asyncio). Each child
is `sys.executable -m <package>.main`, in its own session, so a Ctrl-C in the terminal reaches only
the supervisor, which then stops the children itself: SIGINT to each process group (stop now: the
whole cluster goes, so a worker has nobody to drain for), a grace period, SIGKILL to what is left.
On Linux each child also gets PR_SET_PDEATHSIG=SIGINT, so it is told to stop even when the
supervisor itself is killed with SIGKILL.

`orchestrator scale ROLE=N` writes the wanted counts to `<pid>.scale.json` beside the run record;
the loop takes it up: new workers get the lowest free index, and the highest-numbered ones are
sent SIGTERM, which drains them (common/entrypoint.py). A worker that exits 0 drained on purpose
(scaled down, `orchestrator drain`) and is not restarted.

Child stdout and stderr are inherited: one interleaved stream in which each process's log lines
carry its worker id (common.entrypoint.setup_logging), and a crashed child's traceback appears
just above the supervisor's line about it. Redirect `orchestrator up` itself to keep a log file.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from common.config import ClusterConfig
from common.curve import KEYS_ENV, ClusterKeys, as_client, generate_keys, load_keys
from common.protocol import ClusterInfo, ClusterInfoRequest
from common.transport import make_socket, recv, send
from common.worker_link import EXIT_REFUSED
from orchestrator.run_records import RunRecord, scale_request_path, take_scale_request, write_record

logger = logging.getLogger(__name__)

# The line `orchestrator up` prints once every process is ready and /health said 200: what
# scripts starting a cluster (tests, benchmarks) wait for.
SERVING = "Serving on "

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
RETIRE_MARGIN_S = 10.0  # past its drain timeout, a retiring worker is killed after this long
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
        child.process = subprocess.Popen(
            child.spec.argv,
            env={**os.environ, **dict(child.spec.env)} if child.spec.env else None,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        child.started_at = time.monotonic()
        logger.info("started %s (pid %d)", child.spec.worker_id, child.process.pid)

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
                _signal_group(child.process, signal.SIGKILL)
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
                _signal_group(child.process, signal.SIGTERM)
        taken = {worker_index(c.spec.worker_id) for c in self.children if c.spec.role == role}
        free = (i for i in itertools.count() if i not in taken)
        for index in itertools.islice(free, max(0, count - len(serving))):
            child = Child(make_spec(index), backoff_s=self.backoff_initial_s)
            self.children.append(child)
            logger.info("scaling %s up: starting %s", role, child.spec.worker_id)
            self._start(child)

    def stop(self, timeout_s: float = 8.0) -> None:
        """SIGINT every child's process group (stop now, no drain), wait up to `timeout_s` in
        all, SIGKILL the rest."""
        for child in self.children:
            child.restart_at = None
        running = [(c.spec.worker_id, c.process) for c in self.children if c.process is not None]
        for _, process in running:
            _signal_group(process, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for worker_id, process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s still running %.0fs after SIGINT: killing it", worker_id, timeout_s
                )
                _signal_group(process, signal.SIGKILL)
                process.wait()
        logger.info("stopped %d processes", len(running))


def describe_exit(process: subprocess.Popen[bytes]) -> str:
    """An ended child's status in an operator's words."""
    if process.returncode < 0:
        return f"was killed by {signal.Signals(-process.returncode).name}"
    return f"exited with code {process.returncode}"


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """The child and whatever it started (start_new_session: its pid is the group id); only while
    it is unreaped, since a reaped child's pid may already name another process group."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A preexec_fn that has Linux send the child SIGINT when the supervisor dies, even by SIGKILL.

    PDEATHSIG fires when the forking *thread* ends, so children are started from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGINT)
        if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGINT)

    return preexec


# --- readiness ------------------------------------------------------------------------------------


def query_cluster_info(
    address: str, timeout_s: float, keys: ClusterKeys | None = None
) -> ClusterInfo | None:
    """One ClusterInfoRequest to the orchestrator; None when it does not answer in time (or, a
    CURVE orchestrator, when `keys` are not the cluster's)."""
    sock: zmq.Socket = make_socket(zmq.Context.instance(), zmq.DEALER)
    as_client(sock, keys)
    sock.connect(address)
    try:
        send(sock, ClusterInfoRequest())
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = recv(sock, f"the orchestrator at {address}")
        return reply if isinstance(reply, ClusterInfo) else None
    finally:
        sock.close()


def is_healthy(url: str, timeout_s: float = 1.0) -> bool:
    """GET url answers 200. Proxies are bypassed: the frontend is on this host or its network."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


@dataclass(slots=True)
class StartupReport:
    """What start-up saw last: enough to print a table, or to say what is missing."""

    missing: list[str]  # expected worker ids not listed as ready
    info: ClusterInfo | None = None  # the orchestrator's last answer
    healthy: bool = False  # the frontend's /health answered 200
    dead: list[Child] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.missing and self.healthy and not self.dead


def wait_until_ready(
    supervisor: Supervisor,
    *,
    expected: list[str],
    orchestrator_address: str,
    health_url: str,
    timeout_s: float,
    should_stop: Callable[[], bool] = lambda: False,
    keys: ClusterKeys | None = None,
) -> StartupReport:
    """Poll ClusterInfo until every expected worker is ready, then the frontend's /health."""
    deadline = time.monotonic() + timeout_s
    report = StartupReport(missing=list(expected))
    while not should_stop():
        report.dead = supervisor.exited()
        if report.dead:
            return report
        info = query_cluster_info(orchestrator_address, timeout_s=1.0, keys=keys)
        if info is not None:
            report.info = info
            ready = {w.worker_id for w in info.workers if w.state == "ready"}
            report.missing = [worker_id for worker_id in expected if worker_id not in ready]
            report.healthy = not report.missing and is_healthy(health_url)
            if report.ready:
                return report
        if time.monotonic() >= deadline:
            return report
        time.sleep(0.2)
    return report


def describe_failure(report: StartupReport, timeout_s: float) -> str:
    """Why start-up failed, for the operator: who died (its output is above), who never came up."""
    lines = []
    for child in report.dead:
        assert child.process is not None
        what = f"{child.spec.worker_id} (pid {child.process.pid}) {describe_exit(child.process)}"
        lines.append(f"{what} during start-up (its output is above)")
    if not report.dead:
        lines.append(f"the cluster was not ready after {timeout_s:.0f}s")
    if report.info is None:
        lines.append("the orchestrator never answered")
    elif report.missing:
        lines.append("not registered or not ready: " + ", ".join(report.missing))
    elif not report.healthy:
        lines.append("the frontend's /health did not answer 200")
    return "\n".join(lines)


def format_table(info: ClusterInfo) -> str:
    """The status table `orchestrator up` prints once the cluster serves."""
    rows = [("ROLE", "WORKER", "PID", "ADDRESS", "STATE", "BLOCKS USED/TOTAL")]
    for w in info.workers:
        blocks = f"{w.blocks_used}/{w.blocks_total}" if w.blocks_total else "-"
        rows.append((w.role, w.worker_id, str(w.pid), w.address or "-", w.state, blocks))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# --- `orchestrator up` ----------------------------------------------------------------------------


@dataclass(slots=True)
class StopRequest:
    """Set by SIGINT / SIGTERM; the supervisor's loops check it between short sleeps."""

    requested: bool = False

    def install(self) -> None:
        def handler(signum: int, frame: object) -> None:
            if not self.requested:
                logger.info("%s: stopping the cluster", signal.Signals(signum).name)
            self.requested = True

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


def cluster_keys_for_run(config: ClusterConfig) -> tuple[str | None, ClusterKeys | None]:
    """(keys directory, keys) for this run: `security.keys_dir`, else a new pair in a private
    temporary directory; (None, None) when `security.curve` is off."""
    if not config.security.curve:
        return None, None
    if config.security.keys_dir:
        return config.security.keys_dir, load_keys(Path(config.security.keys_dir))
    keys_dir = tempfile.mkdtemp(prefix="pdcluster-keys-")  # 0700
    return keys_dir, generate_keys(Path(keys_dir))


def run_cluster(
    config: ClusterConfig,
    config_path: str | None,
    *,
    ready_timeout_s: float = 300.0,
) -> int:
    """Start, wait until serving, print the table, supervise until a signal; 0 on a clean stop."""
    stop = StopRequest()
    stop.install()
    metrics_dir = tempfile.mkdtemp(prefix="pdcluster-metrics-")  # fresh: no stale counters
    keys_dir, keys = cluster_keys_for_run(config)
    specs = process_specs(config, config_path, metrics_dir, keys_dir)
    supervisor = Supervisor(specs)
    host = config.frontend.host
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    record = RunRecord(
        pid=os.getpid(),
        orchestrator_address=config.orchestrator.address,
        url=f"http://{client_host}:{config.frontend.port}",
        config_path=os.path.abspath(config_path) if config_path else None,
        keys_dir=keys_dir,
    )
    record_path = write_record(record)
    try:
        supervisor.start()
        report = wait_until_ready(
            supervisor,
            expected=[s.worker_id for s in specs if s.role != "orchestrator"],
            orchestrator_address=config.orchestrator.address,
            health_url=f"http://{client_host}:{config.frontend.port}/health",
            timeout_s=ready_timeout_s,
            should_stop=lambda: stop.requested,
            keys=keys,
        )
        if stop.requested:
            return 0
        if not report.ready:
            print(describe_failure(report, ready_timeout_s), file=sys.stderr)
            return 1
        assert report.info is not None
        print(format_table(report.info))
        print(f"{SERVING}http://{host}:{config.frontend.port}/v1", flush=True)
        scale_path = scale_request_path(record.pid)
        while not stop.requested:
            for role, count in take_scale_request(scale_path).items():
                make_spec = functools.partial(
                    worker_spec, role, config_path=config_path, keys_dir=keys_dir
                )
                supervisor.scale(role, count, make_spec, config.orchestrator.drain_timeout_seconds)
            supervisor.poll()
            time.sleep(0.2)
        return 0
    finally:
        supervisor.stop()
        record_path.unlink(missing_ok=True)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if keys_dir and not config.security.keys_dir:  # this run's own pair: gone with it
            shutil.rmtree(keys_dir, ignore_errors=True)
