"""`orchestrator status` without a file: the records of running supervisors pick the cluster."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.run_records import RunRecord, running_clusters, write_record
from orchestrator import cli

SILENT = "tcp://127.0.0.1:9"  # nothing answers there: status names the address it asked


@pytest.fixture
def supervisors() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Stand-ins for `orchestrator up` processes (a live pid whose command line says so)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait(10)


def fake_supervisor(started: list[subprocess.Popen[bytes]]) -> int:
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "orchestrator"]
    )
    started.append(process)
    return process.pid


def record(pid: int, config: str | None = None) -> RunRecord:
    return RunRecord(pid=pid, orchestrator_address=SILENT, url="http://x", config_path=config)


def test_stale_records_are_dropped(tmp_path: Path, supervisors: list) -> None:
    live = fake_supervisor(supervisors)
    write_record(record(live), tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass", "orchestrator"])
    dead.wait(10)
    write_record(record(dead.pid), tmp_path)
    write_record(record(1), tmp_path)  # alive, but not a supervisor (a reused pid)
    assert [r.pid for r in running_clusters(tmp_path)] == [live]
    assert [p.name for p in tmp_path.iterdir()] == [f"{live}.json"]


def test_status_asks_the_one_running_cluster(
    tmp_path: Path, supervisors: list, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.status(None, records_dir=tmp_path) == 1  # none running: the default address
    assert "tcp://127.0.0.1:5550" in capsys.readouterr().err
    write_record(record(fake_supervisor(supervisors)), tmp_path)
    assert cli.status(None, records_dir=tmp_path) == 1
    assert SILENT in capsys.readouterr().err  # the running cluster's address, not the default


def test_status_with_several_running_asks_for_the_file(
    tmp_path: Path, supervisors: list, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a.yaml", "b.yaml"):
        write_record(record(fake_supervisor(supervisors), f"/configs/{name}"), tmp_path)
    assert cli.status(None, records_dir=tmp_path) == 2
    err = capsys.readouterr().err
    assert "2 clusters are running" in err and "/configs/a.yaml" in err and "/configs/b.yaml" in err
