"""`orchestrator up`: start every process of the cluster, wait until it serves, keep it alive.

A plain synchronous loop over child processes (no torch, no asyncio), each `sys.executable -m
<package>.main` (specs.py) in its own session (processes.py). Once every process is ready and
/health said 200 it prints the table and SERVING, then supervises (supervisor.py) and takes up
the counts `orchestrator scale ROLE=N` leaves in `<pid>.scale.json` beside the run record.

Child stdout and stderr are inherited: one interleaved stream in which each process's log lines
carry its worker id (common.entrypoint.setup_logging), and a crashed child's traceback appears
just above the supervisor's line about it. Redirect `orchestrator up` itself to keep a log file.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import ClusterConfig
from common.curve import ClusterKeys, generate_keys, load_keys
from launcher.readiness import describe_failure, format_table, wait_until_ready
from launcher.run_records import RunRecord, scale_request_path, take_scale_request, write_record
from launcher.specs import process_specs, worker_spec
from launcher.supervisor import Supervisor

logger = logging.getLogger(__name__)

# The line `orchestrator up` prints once every process is ready and /health said 200: what
# scripts starting a cluster (tests, benchmarks) wait for.
SERVING = "Serving on "


@dataclass(slots=True)
class StopRequest:
    """Set by SIGINT / SIGTERM; the launcher's loops check it between short sleeps."""

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
