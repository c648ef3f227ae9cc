"""What every process's `main.py` does: read its arguments and cluster.yaml, set up logging, turn
SIGTERM / SIGINT into a flag its loop checks (so shutdown frees what the process holds), and, for
workers, register and run the step loop.

A worker tells the two signals apart: SIGINT stops it now (Ctrl-C; `orchestrator up` stopping the
whole cluster, where there is nobody left to finish requests for), SIGTERM drains it (what
Kubernetes sends a pod, and `orchestrator scale` a worker it removes): no new work, what it holds
finishes within `orchestrator.drain_timeout_seconds`, then it leaves and exits 0."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from zmq.auth.base import Authenticator

from common.config import ClusterConfig, load_cluster_config
from common.curve import MissingKeys, cluster_keys, secure
from common.worker_link import EXIT_REFUSED
from common.worker_process import WorkerProcess

logger = logging.getLogger(__name__)


def parse_args(description: str, argv: list[str] | None = None) -> tuple[ClusterConfig, str]:
    """(config, worker id) from `--config PATH --worker-id ID`; no --config means the defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="cluster.yaml (default: the built-in local cluster)")
    parser.add_argument("--worker-id", required=True, help="unique name, e.g. gen-0")
    parser.add_argument(
        "--advertise-host", help="the address peers dial for this process (e.g. its pod IP)"
    )
    args = parser.parse_args(argv)
    config = load_cluster_config(args.config) if args.config else ClusterConfig()
    if args.advertise_host:
        config = msgspec.structs.replace(config, advertise_host=args.advertise_host)
    return config, args.worker_id


def secure_context(context: zmq.Context, config: ClusterConfig) -> Authenticator | None:
    """CURVE for every socket of this process's context (common/curve.py), with the keys
    `orchestrator up` passed in the environment or `security.keys_dir`; the ZAP handler to
    stop at exit, None when `security.curve` is off. Missing keys end the process (exit 2)."""
    try:
        keys = cluster_keys(config, os.environ)
    except MissingKeys as e:
        logger.error("%s", e)
        sys.exit(EXIT_REFUSED)
    return None if keys is None else secure(context, keys)


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


def worker_signals() -> tuple[threading.Event, threading.Event]:
    """(stop, drain): set by SIGINT and SIGTERM respectively."""
    stop, drain = threading.Event(), threading.Event()
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    signal.signal(signal.SIGTERM, lambda signum, frame: drain.set())
    return stop, drain


def run_worker(
    description: str,
    make_worker: Callable[[ClusterConfig, str, zmq.Context], WorkerProcess],
    argv: list[str] | None = None,
) -> None:
    """A worker process: build it, register, step until SIGINT or drained, release everything."""
    config, worker_id = parse_args(description, argv)
    setup_logging(worker_id)
    stop, drain = worker_signals()
    context = zmq.Context()
    authenticator = secure_context(context, config)
    worker = make_worker(config, worker_id, context)
    try:
        registered = worker.link.register(stop)
        if registered is None:
            return
        worker.on_registered(registered)
        logger.info("registered with the orchestrator at %s", config.orchestrator.address)
        drain_started: float | None = None
        while not stop.is_set():
            if drain.is_set():
                worker.link.drain()
            if worker.link.draining and drain_started is None:
                drain_started = time.monotonic()
            worker.step()
            if drain_started is not None and drain_done(worker, config, drain_started):
                worker.link.leave()
                break
    finally:
        worker.close()
        if authenticator is not None:
            authenticator.stop()
        context.term()
        logger.info("stopped")


def drain_done(worker: WorkerProcess, config: ClusterConfig, started: float) -> bool:
    """A draining worker may leave: it is drained, or its drain time is up (what it still holds
    fails), or it holds nothing and the orchestrator has not answered its Drain for a worker
    timeout (gone: nothing new can come from it)."""
    link, idle, waited_s = worker.link, worker.idle(), time.monotonic() - started
    if link.drained(idle):
        logger.info("drained: leaving")
        return True
    if waited_s > config.orchestrator.drain_timeout_seconds:
        logger.warning("still busy after the %.0f s drain timeout: leaving anyway", waited_s)
        return True
    if (
        idle
        and link.drain_in_flight is None
        and waited_s > config.orchestrator.worker_timeout_seconds
    ):
        logger.warning("the orchestrator never answered the drain: leaving")
        return True
    return False
