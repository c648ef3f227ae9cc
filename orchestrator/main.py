"""`python -m orchestrator.main [--config cluster.yaml]`: the orchestrator process.

A plain loop around one ROUTER socket: every frontend, worker and CLI connects a DEALER to it.
The logic lives in `orchestrator.orchestrator`; this file only moves bytes and keeps time.
"""

from __future__ import annotations

import argparse
import logging
import time

import zmq

from common.config import ClusterConfig, load_cluster_config
from common.cpu_placement import place_light_process
from common.curve import serve
from common.entrypoint import secure_context, setup_logging, stop_on_signals
from common.transport import make_socket, parse, send_to
from orchestrator.orchestrator import Orchestrator

logger = logging.getLogger(__name__)

TICK_S = 0.1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Orchestrator")
    parser.add_argument("--config", help="cluster.yaml (default: the built-in local cluster)")
    args = parser.parse_args(argv)
    config = load_cluster_config(args.config) if args.config else ClusterConfig()
    setup_logging("orchestrator")
    place_light_process(config)  # off the engines' cores
    stop = stop_on_signals()
    context = zmq.Context()
    authenticator = secure_context(context, config)
    address = config.orchestrator.address
    sock = make_socket(context, zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its old identity
    serve(sock)
    sock.bind(config.orchestrator.bind or address)
    orchestrator = Orchestrator(config, address)
    logger.info(
        "listening on %s (mode %s, router %s)", address, config.mode, config.orchestrator.router
    )
    next_tick = 0.0
    try:
        while not stop.is_set():
            if sock.poll(int(TICK_S * 1000)):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sender = frames[0]
                    message = parse(frames[-1], sender.decode(errors="replace"))
                    if message is not None:
                        for recipient, reply in orchestrator.handle(
                            sender, message, time.monotonic()
                        ):
                            send_to(sock, recipient, reply)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                for recipient, reply in orchestrator.tick(now):
                    send_to(sock, recipient, reply)
    finally:
        sock.close()
        if authenticator is not None:
            authenticator.stop()
        context.term()
    logger.info("stopped")


if __name__ == "__main__":
    main()
