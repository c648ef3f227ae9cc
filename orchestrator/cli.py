"""The `orchestrator` command: build a builtin model or download a hub one, bring a cluster up,
report its status, scale it, drain a worker."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from common.builtin_models import BUILTIN_MODELS, TINY, builtin_model, resolve_model_dir
from common.config import ClusterConfig, ConfigError, load_cluster_config
from common.curve import ClusterKeys, as_client, generate_keys, load_keys
from common.hub_models import download_snapshot, parse_hub_id, prepare_snapshot
from common.model_cache import is_verified
from common.protocol import ClusterInfo, Drain
from common.transport import make_socket, send
from launcher.readiness import query_cluster_info
from launcher.run import run_cluster
from launcher.run_records import RECORDS_DIR, RunRecord, request_scale, running_clusters
from launcher.specs import WORKER_MODULES

STATUS_TIMEOUT_S = 2.0
WAIT_POLL_S = 0.5


def build_model(model: str, dtype: str = "float32") -> int:
    """Build (or verify) a builtin in a child process: the orchestrator never imports torch."""
    return subprocess.call([sys.executable, "-m", "engine.builtin_build", model, "--dtype", dtype])


def download(model: str) -> int:
    """Fetch a hub id's serving files into the Hugging Face cache, asking the hub for the
    revision's current commit even when a snapshot is cached (`up` would reuse that one)."""
    try:
        hub = parse_hub_id(model)
        if hub is not None:
            download_snapshot(hub)
            return 0
        message = f"{model!r} is not a Hugging Face id (org/name or org/name@revision)"
    except (ValueError, FileNotFoundError) as exc:
        message = str(exc)
    print(f"error: {message}", file=sys.stderr)
    return 2


def tiny_model(path: str | None) -> int:
    """The tiny model into the cache, or into `path` (a fresh build, not cached)."""
    if path is None:
        return build_model(TINY.name)
    return subprocess.call([sys.executable, "-m", "tools.tiny_model", path])


def load_config(path: str | None) -> ClusterConfig | None:
    """cluster.yaml, or the defaults (= deploy/local/cluster.yaml); None after printing why not."""
    try:
        return load_cluster_config(path) if path else ClusterConfig()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def ensure_model(model: str, dtype: str) -> int:
    """0 when the model directory is usable; a builtin is built first when it is missing or its
    weights no longer match their checksum (under a minute; once per machine), and a hub id
    downloaded when the Hugging Face cache lacks it (here, so that no worker downloads)."""
    builtin = builtin_model(model)
    if builtin is not None:
        if is_verified(builtin.model_dir(dtype if builtin.per_dtype else "float32")):
            return 0
        logging.getLogger(__name__).info("%s is not built yet: building it first", model)
        return 0 if build_model(model, dtype) == 0 else 1
    try:
        hub = parse_hub_id(model)
        if hub is not None:
            prepare_snapshot(hub)
        else:
            resolve_model_dir(model)
        return 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def busy_addresses(config: ClusterConfig) -> list[str]:
    """The cluster's fixed TCP addresses that something already listens on: the orchestrator's
    and the frontend's. Probed with a plain bind (no SO_REUSEPORT), so a running cluster's
    frontend counts as well: a second cluster must not share its port or its orchestrator."""
    wanted = [("the frontend", config.frontend.host, config.frontend.port)]
    orchestrator = config.orchestrator.bind or config.orchestrator.address
    if orchestrator.startswith("tcp://"):
        bind_host, _, bind_port = orchestrator.removeprefix("tcp://").rpartition(":")
        if bind_port.isdigit():
            bind_host = "0.0.0.0" if bind_host == "*" else bind_host
            wanted.append(("the orchestrator", bind_host, int(bind_port)))
    busy = []
    for name, host, port in wanted:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # as the servers bind: past connections in TIME_WAIT do not count, a listener does
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host.strip("[]"), port))
            except OSError as exc:
                busy.append(f"{name} address {host}:{port} is in use ({exc.strerror})")
    return busy


def up(config_path: str | None, ready_timeout_s: float) -> int:
    """Validate, make sure the ports are free and the model exists, then start and supervise
    every process."""
    config = load_config(config_path)
    if config is None:
        return 2
    busy = busy_addresses(config)
    if busy:
        print(f"error: {'; '.join(busy)}: is another cluster running? (`orchestrator status`); "
              "nothing was started", file=sys.stderr)  # fmt: skip
        return 2
    draft = config.speculative.model if config.speculative else None  # built here too
    for model in (config.model, *([draft] if draft else [])):
        rc = ensure_model(model, config.dtype)
        if rc != 0:
            return rc
    return run_cluster(config, config_path, ready_timeout_s=ready_timeout_s)


def client_keys(
    config: ClusterConfig, address: str, keys_dir: str | None, records_dir: Path
) -> ClusterKeys | None:
    """The CURVE keys to ask the orchestrator at `address` with: `keys_dir` (security.keys_dir,
    a Kubernetes Secret), else those of a cluster `orchestrator up` runs here at that address."""
    if not config.security.curve:
        return None
    if keys_dir is None:
        records = [r for r in running_clusters(records_dir) if r.orchestrator_address == address]
        keys_dir = records[0].keys_dir if records else None
    return load_keys(Path(keys_dir)) if keys_dir else None


def status(config_path: str | None, records_dir: Path = RECORDS_DIR) -> int:
    """Print the orchestrator's ClusterInfo as JSON (the same record as GET /cluster_info): of
    the cluster `config_path` describes, else of the one `orchestrator up` runs on this machine,
    else at the default address."""
    config = load_config(config_path)
    if config is None:
        return 2
    address = config.orchestrator.address
    keys_dir = config.security.keys_dir
    running = [] if config_path else running_clusters(records_dir)
    if len(running) > 1:
        listing = "\n".join(f"  pid {r.pid}: {r.config_path or '(defaults)'}" for r in running)
        print(
            f"error: {len(running)} clusters are running; name one's cluster.yaml:\n{listing}",
            file=sys.stderr,
        )
        return 2
    if running:
        address, keys_dir = running[0].orchestrator_address, running[0].keys_dir
    keys = client_keys(config, address, keys_dir, records_dir)
    info = query_cluster_info(address, timeout_s=STATUS_TIMEOUT_S, keys=keys)
    if info is None:
        print(
            f"error: the orchestrator at {address} did not answer within {STATUS_TIMEOUT_S:.0f}s "
            "(is the cluster up? `orchestrator up`)",
            file=sys.stderr,
        )
        return 1
    print(msgspec.json.format(msgspec.json.encode(info), indent=2).decode())
    return 0


def probe(worker_id: str, config_path: str | None, alive: bool = False) -> int:
    """0 when the orchestrator lists `worker_id` as ready (can take work: not stalled, not
    draining), or with `alive` as alive (ready, stalled or draining): a worker's Kubernetes
    readiness and liveness probes (workers serve no HTTP; being registered and heartbeating is
    their health)."""
    config = load_config(config_path)
    if config is None:
        return 2
    address = config.orchestrator.address
    keys = client_keys(config, address, config.security.keys_dir, RECORDS_DIR)
    info = query_cluster_info(address, timeout_s=STATUS_TIMEOUT_S, keys=keys)
    if info is None:
        print("error: the orchestrator did not answer", file=sys.stderr)
        return 1
    states = ("ready", "stalled", "draining") if alive else ("ready",)
    ready = any(w.worker_id == worker_id and w.state in states for w in info.workers)
    if not ready:
        print(f"error: {worker_id} is not registered and {states[-1]}", file=sys.stderr)
    return 0 if ready else 1


def drain(worker_id: str, config_path: str | None, timeout_s: float | None) -> int:
    """Ask the orchestrator to drain `worker_id` and wait until it has left: a worker pod's
    preStop hook (Kubernetes then sends SIGTERM, which finds it gone or draining already).
    0 when it left (or was not there), 1 when it is still there after the timeout."""
    config = load_config(config_path)
    if config is None:
        return 2
    address = config.orchestrator.address
    keys = client_keys(config, address, config.security.keys_dir, RECORDS_DIR)
    sock: zmq.Socket[bytes] = make_socket(zmq.Context.instance(), zmq.DEALER)
    as_client(sock, keys)
    sock.connect(address)
    try:
        send(sock, Drain(worker_id=worker_id))
    finally:
        sock.close(linger=int(STATUS_TIMEOUT_S * 1000))
    wait_s = config.orchestrator.drain_timeout_seconds + 5 if timeout_s is None else timeout_s

    def gone(info: ClusterInfo) -> bool:
        return not any(w.worker_id == worker_id and w.state != "dead" for w in info.workers)

    if wait_for_cluster(address, keys, gone, wait_s):
        return 0
    print(f"error: {worker_id} has not left after {wait_s:.0f}s", file=sys.stderr)
    return 1


def wait_for_cluster(
    address: str, keys: ClusterKeys | None, done: Callable[[ClusterInfo], bool], timeout_s: float
) -> bool:
    """Poll ClusterInfo until `done` holds; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = query_cluster_info(address, timeout_s=STATUS_TIMEOUT_S, keys=keys)
        if info is not None and done(info):
            return True
        time.sleep(WAIT_POLL_S)
    return False


def parse_counts(items: list[str], config: ClusterConfig) -> dict[str, int] | str:
    """`generation=3 context=1` as {role: count}, or why not."""
    roles = [r for r in WORKER_MODULES if r != "context" or config.mode == "disaggregated"]
    counts = {}
    for item in items:
        role, _, count = item.partition("=")
        if role not in roles or not count.isdigit() or int(count) < 1:
            return f"{item!r}: want ROLE=N with N >= 1 and ROLE one of {', '.join(roles)}"
        counts[role] = int(count)
    return counts


def scale(
    items: list[str], config_path: str | None, timeout_s: float, records_dir: Path = RECORDS_DIR
) -> int:
    """Have the cluster `orchestrator up` runs here (the one started with `config_path`, when
    given) run these numbers of workers, and wait until it does: the new ones ready, the
    removed ones drained and gone."""
    running = running_clusters(records_dir)
    if config_path is not None:
        running = [r for r in running if r.config_path == os.path.abspath(config_path)]
    if len(running) != 1:
        print(f"error: {len(running)} clusters run here; `orchestrator scale` needs one started "
              "by `orchestrator up` (name its cluster.yaml with --config)",
              file=sys.stderr)  # fmt: skip
        return 2
    record = running[0]
    config = load_config(record.config_path)
    if config is None:
        return 2
    counts = parse_counts(items, config)
    if isinstance(counts, str):
        print(f"error: {counts}", file=sys.stderr)
        return 2
    request_scale(record.pid, counts, records_dir)
    if wait_for_cluster(record.orchestrator_address, record_keys(config, record),
                        lambda info: scaled(info, counts), timeout_s):  # fmt: skip
        return 0
    print(f"error: the cluster did not reach {counts} in {timeout_s:.0f}s", file=sys.stderr)
    return 1


def record_keys(config: ClusterConfig, record: RunRecord) -> ClusterKeys | None:
    return load_keys(Path(record.keys_dir)) if config.security.curve and record.keys_dir else None


def scaled(info: ClusterInfo, counts: dict[str, int]) -> bool:
    """Exactly `count` workers of each role, all ready (none draining, none starting)."""
    for role, count in counts.items():
        states = [w.state for w in info.workers if w.role == role and w.state != "dead"]
        if len(states) != count or any(state != "ready" for state in states):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orchestrator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-model", help="build a builtin model into the cache")
    build.add_argument("model", help="a builtin: " + ", ".join(BUILTIN_MODELS))
    build.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    fetch = commands.add_parser(
        "download", help="download a Hugging Face model's serving files into the hub cache"
    )
    fetch.add_argument("model", help="org/name or org/name@revision (a branch, tag or commit)")
    make_keys = commands.add_parser("keys", help="write a new CURVE keypair for a cluster")
    make_keys.add_argument("directory", help="where (created 0700; for a Kubernetes Secret)")
    tiny = commands.add_parser("tiny-model", help="build the deterministic tiny model (offline)")
    tiny.add_argument("path", nargs="?", help="output directory (default: the builtin:tiny cache)")
    start = commands.add_parser("up", help="start the cluster and keep it running until Ctrl-C")
    report = commands.add_parser("status", help="print the running cluster's workers as JSON")
    check = commands.add_parser("probe", help="exit 0 when a worker is registered and ready")
    check.add_argument("worker_id")
    check.add_argument("config", nargs="?", help="cluster.yaml (default: the built-in one)")
    check.add_argument("--alive", action="store_true",
                       help="pass while stalled or draining too (a liveness probe)")  # fmt: skip
    resize = commands.add_parser(
        "scale", help="run N workers of a role in the cluster `orchestrator up` runs here"
    )
    resize.add_argument("counts", nargs="+", metavar="ROLE=N", help="generation=3 context=1 ...")
    resize.add_argument("--config", help="the cluster.yaml it was started with")
    resize.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="wait this long for the new size (default: 300)")  # fmt: skip
    retire = commands.add_parser(
        "drain", help="drain a worker (no new work, its requests finish) and wait until it left"
    )
    retire.add_argument("worker_id")
    retire.add_argument("config", nargs="?", help="cluster.yaml (default: the built-in one)")
    retire.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="default: orchestrator.drain_timeout_seconds + 5")  # fmt: skip
    for command in (start, report):
        command.add_argument(
            "config", nargs="?", help="cluster.yaml (default: the built-in local cluster)"
        )
    start.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up if the cluster is not serving after this long (default: 300)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per request of a download
    if args.command == "keys":
        generate_keys(Path(args.directory))
        print(f"wrote {args.directory}/cluster.key and cluster.key_secret")
        return 0
    if args.command == "build-model":
        return build_model(args.model, args.dtype)
    if args.command == "download":
        return download(args.model)
    if args.command == "tiny-model":
        return tiny_model(args.path)
    if args.command == "up":
        return up(args.config, args.timeout)
    if args.command == "status":
        return status(args.config)
    if args.command == "probe":
        return probe(args.worker_id, args.config, args.alive)
    if args.command == "scale":
        return scale(args.counts, args.config, args.timeout)
    if args.command == "drain":
        return drain(args.worker_id, args.config, args.timeout)
    return 2


if __name__ == "__main__":
    sys.exit(main())
