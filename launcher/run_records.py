"""Which clusters `orchestrator up` is running on this machine, so `orchestrator status` finds
one without being given its cluster.yaml.

Each launcher (`orchestrator up`) writes ~/.cache/pdcluster/clusters/<pid>.json while it runs
and removes it when it stops; a record whose process is gone (a launcher killed with SIGKILL) is
stale and deleted by the next reader. `orchestrator scale` leaves its wanted counts beside it in
<pid>.scale.json, which the launcher takes up: the directory is this user's, so only this
user (or root) can ask.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from common.model_cache import CACHE_ROOT

RECORDS_DIR = CACHE_ROOT / "clusters"


class RunRecord(msgspec.Struct, frozen=True):
    pid: int  # the supervisor's
    orchestrator_address: str
    url: str  # the frontend's base URL
    config_path: str | None  # None: the built-in defaults
    keys_dir: str | None = None  # its CURVE keys (a private directory: this user's processes)


def write_record(record: RunRecord, records_dir: Path = RECORDS_DIR) -> Path:
    records_dir.mkdir(parents=True, exist_ok=True)
    path = records_dir / f"{record.pid}.json"
    path.write_bytes(msgspec.json.encode(record))
    return path


def scale_request_path(pid: int, records_dir: Path = RECORDS_DIR) -> Path:
    return records_dir / f"{pid}.scale.json"


def request_scale(pid: int, counts: dict[str, int], records_dir: Path = RECORDS_DIR) -> None:
    """Ask the supervisor `pid` for these worker counts (merged with a request not taken yet)."""
    path = scale_request_path(pid, records_dir)
    wanted = {**take_scale_request(path), **counts}
    partial = path.with_suffix(".partial")
    partial.write_bytes(msgspec.json.encode(wanted))
    partial.rename(path)  # whole or not at all: the supervisor may read it any time


def take_scale_request(path: Path) -> dict[str, int]:
    """The counts asked for since the last call (and forget them); {} when none."""
    try:
        data = path.read_bytes()
        path.unlink()
        return msgspec.json.decode(data, type=dict[str, int])
    except (OSError, msgspec.DecodeError):
        return {}


def running_clusters(records_dir: Path = RECORDS_DIR) -> list[RunRecord]:
    """The records of live supervisors, oldest pid first; stale records are removed."""
    records = []
    for path in sorted(records_dir.glob("*.json")):
        if not path.stem.isdigit():
            continue  # <pid>.scale.json
        try:
            record = msgspec.json.decode(path.read_bytes(), type=RunRecord)
        except (OSError, msgspec.DecodeError):
            continue
        if _alive(record.pid):
            records.append(record)
        else:
            path.unlink(missing_ok=True)
    return sorted(records, key=lambda r: r.pid)


def _alive(pid: int) -> bool:
    """The supervisor still runs (not another process that was given its pid since)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the signal check
    return not cmdline or b"orchestrator" in cmdline  # empty while a process execs
