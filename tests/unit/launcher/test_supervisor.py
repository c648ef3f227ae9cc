"""`orchestrator up` / `status`: the process list, restarts, shutdown, readiness, the CLI.

Children are stand-ins (`python -c ...`), never the real cluster; every one is ended by the test.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from common.config import ClusterConfig, parse_cluster_config
from common.protocol import ClusterInfo, ClusterInfoRequest, WorkerInfo
from common.transport import bind_random_port, make_socket, parse, send_to
from launcher.readiness import format_table, wait_until_ready
from launcher.specs import ProcessSpec, process_specs
from launcher.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[3]
SLEEPER = "import time; time.sleep(60)"

pytestmark = pytest.mark.timeout(60)


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    """Every supervisor a test makes is stopped afterwards, so no child outlives the test."""
    made: list[Supervisor] = []
    yield made
    for supervisor in made:
        supervisor.stop(timeout_s=1.0)


def cluster_info(*worker_ids: str) -> ClusterInfo:
    """The orchestrator's own row, then one ready generation worker per id."""
    rows = [("orchestrator", "orchestrator", 1, "")]
    rows += [(w, "generation", 2, "tcp://127.0.0.1:1") for w in worker_ids]
    workers = [
        WorkerInfo(worker_id=w, role=role, pid=pid, address=address, state="ready")
        for w, role, pid, address in rows
    ]
    return ClusterInfo(workers=workers, num_requests=3)


@contextlib.contextmanager
def fake_orchestrator(info: ClusterInfo) -> Iterator[str]:
    """A ROUTER on a free loopback port that answers every ClusterInfoRequest with `info`."""
    context = zmq.Context()
    sock = make_socket(context, zmq.ROUTER)
    address = bind_random_port(sock, "127.0.0.1")
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if sock.poll(20):
                frames = sock.recv_multipart()
                if isinstance(parse(frames[-1], "test"), ClusterInfoRequest):
                    send_to(sock, frames[0], info)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        done.set()
        thread.join(timeout=5)
        sock.close()
        context.term()


@contextlib.contextmanager
def health_server() -> Iterator[str]:
    """An HTTP server on a free loopback port whose /health answers 200."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


# --- the process list -----------------------------------------------------------------------------


def test_disaggregated_cluster_starts_orchestrator_first_then_every_worker() -> None:
    specs = process_specs(ClusterConfig(), None)
    ids = ["orchestrator", "ctx-0", "gen-0", "pp-0", "pp-1", "fe-0"]
    assert [s.worker_id for s in specs] == ids
    assert specs[0].argv == (sys.executable, "-m", "orchestrator.main")
    assert specs[1].argv == (sys.executable, "-m", "context_worker.main", "--worker-id", "ctx-0")
    assert [s.role for s in specs[2:]] == ["generation", "postproc", "postproc", "frontend"]
    assert specs[-1].argv[2:] == ("frontend.main", "--worker-id", "fe-0")


def test_aggregated_cluster_has_no_context_workers_and_every_process_gets_the_config() -> None:
    config = parse_cluster_config(
        "mode: aggregated\ncontext_workers: {count: 3}\ngeneration_workers: {count: 2}\n"
        "postproc_workers: {count: 1}\nfrontend: {processes: 2}\n"
    )
    specs = process_specs(config, "my.yaml")
    ids = ["orchestrator", "gen-0", "gen-1", "pp-0", "fe-0", "fe-1"]
    assert [s.worker_id for s in specs] == ids
    assert all(s.argv[-2:] == ("--config", "my.yaml") for s in specs)
    assert specs[0].argv == (sys.executable, "-m", "orchestrator.main", "--config", "my.yaml")


# --- restarts and shutdown ------------------------------------------------------------------------


def test_crashed_child_is_restarted_with_a_growing_backoff(
    supervisors: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    spec = ProcessSpec("gen-0", "generation", python("raise SystemExit(1)"))
    supervisor = Supervisor([spec], backoff_initial_s=0.05, backoff_max_s=5.0)
    supervisors.append(supervisor)
    child = supervisor.children[0]
    with caplog.at_level(logging.INFO, logger="launcher.supervisor"):
        supervisor.start()
        assert wait_for(lambda: supervisor.poll() or child.num_restarts >= 2)
    assert not child.gave_up
    assert child.backoff_s == pytest.approx(0.2)  # 0.05 → 0.1 → 0.2 after two crashes
    assert "gen-0 (pid" in caplog.text and "exited with code 1" in caplog.text
    assert "restarting it in" in caplog.text


def test_child_exiting_with_code_2_is_not_restarted(
    supervisors: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    spec = ProcessSpec("pp-0", "postproc", python("raise SystemExit(2)"))
    supervisor = Supervisor([spec], backoff_initial_s=0.01)
    supervisors.append(supervisor)
    child = supervisor.children[0]
    with caplog.at_level(logging.INFO, logger="launcher.supervisor"):
        supervisor.start()
        assert wait_for(lambda: supervisor.poll() or child.gave_up)
        wait_for(lambda: supervisor.poll() or False, timeout_s=0.3)
    assert child.num_restarts == 0 and child.process is None
    assert "pp-0" in caplog.text and "not restarting" in caplog.text


def test_a_child_that_exits_0_drained_is_removed_not_restarted(
    supervisors: list[Supervisor],
) -> None:
    supervisor = Supervisor([ProcessSpec("gen-1", "generation", python("pass"))])
    supervisors.append(supervisor)
    supervisor.start()
    assert wait_for(lambda: supervisor.poll() or not supervisor.children)


def test_scale_starts_the_lowest_free_ids_and_drains_the_highest_with_sigterm(
    supervisors: list[Supervisor], tmp_path: Path
) -> None:
    drained = tmp_path / "drained"
    drains = (  # exits 0 on SIGTERM, as a drained worker does
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
        f"(pathlib.Path({str(drained)!r}).touch(), sys.exit(0))); time.sleep(60)"
    )

    def make_spec(index: int) -> ProcessSpec:
        return ProcessSpec(f"gen-{index}", "generation", python(drains))

    supervisor = Supervisor([make_spec(0), ProcessSpec("pp-0", "postproc", python(SLEEPER))])
    supervisors.append(supervisor)
    supervisor.start()
    supervisor.scale("generation", 3, make_spec, drain_s=5.0)
    assert [c.spec.worker_id for c in supervisor.children] == ["gen-0", "pp-0", "gen-1", "gen-2"]
    time.sleep(0.5)  # the children install their handlers
    supervisor.scale("generation", 1, make_spec, drain_s=5.0)
    assert wait_for(lambda: supervisor.poll() or len(supervisor.children) == 2)
    assert [c.spec.worker_id for c in supervisor.children] == ["gen-0", "pp-0"]
    assert drained.exists() and all(c.num_restarts == 0 for c in supervisor.children)
    supervisor.scale("generation", 2, make_spec, drain_s=5.0)
    assert supervisor.children[-1].spec.worker_id == "gen-1"


def test_stop_ends_every_child_within_10s_even_one_that_ignores_sigint(
    supervisors: list[Supervisor], tmp_path: Path
) -> None:
    marker = tmp_path / "ignoring"
    stubborn = (
        "import pathlib, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        f"pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    )
    supervisor = Supervisor(
        [
            ProcessSpec("gen-0", "generation", python(SLEEPER)),
            ProcessSpec("pp-0", "postproc", python(stubborn)),
        ]
    )
    supervisors.append(supervisor)
    supervisor.start()
    assert wait_for(marker.exists)
    start = time.monotonic()
    supervisor.stop(timeout_s=1.0)
    assert time.monotonic() - start < 10
    polite, stubborn_child = (c.process for c in supervisor.children)
    assert polite is not None and polite.returncode == -signal.SIGINT  # stop now, not drain
    assert stubborn_child is not None and stubborn_child.returncode == -signal.SIGKILL


def process_gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_are_stopped_when_the_supervisor_is_killed_with_sigkill() -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from launcher.specs import ProcessSpec
        from launcher.supervisor import Supervisor
        spec = ProcessSpec("gen-0", "generation", (sys.executable, "-c", {SLEEPER!r}))
        supervisor = Supervisor([spec])
        supervisor.start()
        print(supervisor.children[0].process.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(python(script), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=10)
        assert wait_for(lambda: process_gone(pid))
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()
        if pid is not None and not process_gone(pid):
            os.kill(pid, signal.SIGKILL)


# --- readiness and the table ----------------------------------------------------------------------


def test_ready_once_every_worker_is_listed_ready_and_the_frontend_is_healthy(
    supervisors: list[Supervisor],
) -> None:
    supervisor = Supervisor([ProcessSpec("gen-0", "generation", python(SLEEPER))])
    supervisors.append(supervisor)
    supervisor.start()
    with fake_orchestrator(cluster_info("gen-0")) as address, health_server() as url:
        report = wait_until_ready(
            supervisor,
            expected=["gen-0"],
            orchestrator_address=address,
            health_url=url,
            timeout_s=10,
        )
    assert report.ready and report.info is not None
    assert [w.worker_id for w in report.info.workers] == ["orchestrator", "gen-0"]


def test_startup_names_the_workers_that_are_missing_or_unhealthy(
    supervisors: list[Supervisor],
) -> None:
    supervisor = Supervisor([ProcessSpec("gen-0", "generation", python(SLEEPER))])
    supervisors.append(supervisor)
    supervisor.start()
    no_health = f"http://127.0.0.1:{free_port()}/health"
    with fake_orchestrator(cluster_info("gen-0")) as address:
        missing = wait_until_ready(
            supervisor,
            expected=["gen-0", "pp-0"],
            orchestrator_address=address,
            health_url=no_health,
            timeout_s=0.3,
        )
        unhealthy = wait_until_ready(
            supervisor,
            expected=["gen-0"],
            orchestrator_address=address,
            health_url=no_health,
            timeout_s=0.3,
        )
    assert not missing.ready and missing.missing == ["pp-0"]
    assert not unhealthy.ready and unhealthy.missing == [] and not unhealthy.healthy


def test_startup_fails_fast_when_a_child_dies(supervisors: list[Supervisor]) -> None:
    supervisor = Supervisor(
        [
            ProcessSpec("gen-0", "generation", python(SLEEPER)),
            ProcessSpec("pp-0", "postproc", python("raise SystemExit(1)")),
        ]
    )
    supervisors.append(supervisor)
    supervisor.start()
    start = time.monotonic()
    report = wait_until_ready(
        supervisor,
        expected=["gen-0", "pp-0"],
        orchestrator_address=f"tcp://127.0.0.1:{free_port()}",  # nobody answers
        health_url=f"http://127.0.0.1:{free_port()}/health",
        timeout_s=30,
    )
    assert time.monotonic() - start < 10
    assert [c.spec.worker_id for c in report.dead] == ["pp-0"]
    assert report.info is None and not report.ready


def test_table_has_one_row_per_worker_with_kv_blocks_used_over_total() -> None:
    info = cluster_info("gen-0")
    info.workers[1].blocks_used, info.workers[1].blocks_total = 12, 64
    header, orchestrator_row, worker_row = format_table(info).splitlines()
    assert header.split()[:5] == ["ROLE", "WORKER", "PID", "ADDRESS", "STATE"]
    assert orchestrator_row.split() == ["orchestrator", "orchestrator", "1", "-", "ready", "-"]
    assert worker_row.split() == ["generation", "gen-0", "2", "tcp://127.0.0.1:1", "ready", "12/64"]


# --- the CLI --------------------------------------------------------------------------------------


def test_up_with_an_invalid_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache: {block_size: 0}\n")
    result = run_cli("up", str(bad))
    assert result.returncode == 2
    assert "kv_cache.block_size" in result.stderr
    assert "started" not in result.stderr and "Serving" not in result.stdout


def test_status_prints_the_cluster_info_as_json(tmp_path: Path) -> None:
    info = cluster_info("gen-0")
    with fake_orchestrator(info) as address:
        config = tmp_path / "cluster.yaml"
        config.write_text(f'orchestrator: {{address: "{address}"}}\n')
        result = run_cli("status", str(config))
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["num_requests"] == 3
    assert [(w["worker_id"], w["state"]) for w in printed["workers"]] == [
        ("orchestrator", "ready"),
        ("gen-0", "ready"),
    ]
    assert {"pid", "active_requests", "blocks_used", "blocks_total"} <= printed["workers"][1].keys()


def test_status_without_an_orchestrator_exits_1_saying_so(tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(f'orchestrator: {{address: "tcp://127.0.0.1:{free_port()}"}}\n')
    result = run_cli("status", str(config))
    assert result.returncode == 1
    assert "did not answer" in result.stderr
