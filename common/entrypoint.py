"""What every process's `main.py` does first: read its arguments and cluster.yaml, set up logging,
and turn SIGTERM / SIGINT into a flag its loop checks, so shutdown frees what the process holds."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from common.config import ClusterConfig, load_cluster_config


def parse_args(description: str, argv: list[str] | None = None) -> tuple[ClusterConfig, str]:
    """(config, worker id) from `--config PATH --worker-id ID`; no --config means the defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="cluster.yaml (default: the built-in local cluster)")
    parser.add_argument("--worker-id", required=True, help="unique name, e.g. gen-0")
    args = parser.parse_args(argv)
    config = load_cluster_config(args.config) if args.config else ClusterConfig()
    return config, args.worker_id


def setup_logging(worker_id: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {worker_id} %(levelname)s %(name)s: %(message)s",
    )


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT; loops poll it between steps."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
