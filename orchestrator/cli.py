"""The `orchestrator` command: build the tiny model, bring a cluster up, report its status."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import msgspec

from common.config import ClusterConfig, ConfigError, load_cluster_config
from common.tokenizer import BUILTIN_TINY, resolve_model_dir
from orchestrator.supervisor import query_cluster_info, run_cluster

STATUS_TIMEOUT_S = 2.0


def tiny_model(path: str | None) -> int:
    """Build the tiny model in a child process: the orchestrator itself never imports torch."""
    cmd = [sys.executable, "-m", "engine.tiny_model"] + ([path] if path else [])
    return subprocess.call(cmd)


def load_config(path: str | None) -> ClusterConfig | None:
    """cluster.yaml, or the defaults (= deploy/local/cluster.yaml); None after printing why not."""
    try:
        return load_cluster_config(path) if path else ClusterConfig()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def ensure_model(model: str) -> int:
    """0 when the model directory is usable; builds builtin:tiny on first use (about a minute)."""
    try:
        resolve_model_dir(model)
        return 0
    except FileNotFoundError as exc:
        if model != BUILTIN_TINY:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    logging.getLogger(__name__).info("the tiny model is not built yet: building it first")
    return 0 if tiny_model(None) == 0 else 1


def up(config_path: str | None, ready_timeout_s: float) -> int:
    """Validate, make sure the model exists, then start and supervise every process."""
    config = load_config(config_path)
    if config is None:
        return 2
    rc = ensure_model(config.model)
    if rc != 0:
        return rc
    return run_cluster(config, config_path, ready_timeout_s=ready_timeout_s)


def status(config_path: str | None) -> int:
    """Print the orchestrator's ClusterInfo as JSON (the same record as GET /cluster_info)."""
    config = load_config(config_path)
    if config is None:
        return 2
    address = config.orchestrator.address
    info = query_cluster_info(address, timeout_s=STATUS_TIMEOUT_S)
    if info is None:
        print(
            f"error: the orchestrator at {address} did not answer within {STATUS_TIMEOUT_S:.0f}s "
            "(is the cluster up? `orchestrator up`)",
            file=sys.stderr,
        )
        return 1
    print(msgspec.json.format(msgspec.json.encode(info), indent=2).decode())
    return 0


def probe(worker_id: str, config_path: str | None) -> int:
    """0 when the orchestrator lists `worker_id` as ready: a worker's Kubernetes probe (workers
    serve no HTTP; being registered and heartbeating is their health)."""
    config = load_config(config_path)
    if config is None:
        return 2
    info = query_cluster_info(config.orchestrator.address, timeout_s=STATUS_TIMEOUT_S)
    if info is None:
        print("error: the orchestrator did not answer", file=sys.stderr)
        return 1
    ready = any(w.worker_id == worker_id and w.state == "ready" for w in info.workers)
    if not ready:
        print(f"error: {worker_id} is not registered and ready", file=sys.stderr)
    return 0 if ready else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orchestrator", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("tiny-model", help="build the deterministic tiny model (offline)")
    build.add_argument("path", nargs="?", help="output directory (default: the builtin:tiny cache)")
    start = commands.add_parser("up", help="start the cluster and keep it running until Ctrl-C")
    report = commands.add_parser("status", help="print the running cluster's workers as JSON")
    check = commands.add_parser("probe", help="exit 0 when a worker is registered and ready")
    check.add_argument("worker_id")
    check.add_argument("config", nargs="?", help="cluster.yaml (default: the built-in one)")
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
    if args.command == "tiny-model":
        return tiny_model(args.path)
    if args.command == "up":
        return up(args.config, args.timeout)
    if args.command == "status":
        return status(args.config)
    if args.command == "probe":
        return probe(args.worker_id, args.config)
    return 2


if __name__ == "__main__":
    sys.exit(main())
