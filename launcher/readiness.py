"""Start-up: asking the orchestrator who is ready, the frontend's /health, what failed, and the
table `orchestrator up` prints once the cluster serves."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from common.curve import ClusterKeys, as_client
from common.protocol import ClusterInfo, ClusterInfoRequest
from common.transport import make_socket, recv, send
from launcher.processes import describe_exit
from launcher.supervisor import Child, Supervisor


def query_cluster_info(
    address: str, timeout_s: float, keys: ClusterKeys | None = None
) -> ClusterInfo | None:
    """One ClusterInfoRequest to the orchestrator; None when it does not answer in time (or, a
    CURVE orchestrator, when `keys` are not the cluster's)."""
    sock: zmq.Socket[bytes] = make_socket(zmq.Context.instance(), zmq.DEALER)
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
            status: int = response.status
            return status == 200
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
