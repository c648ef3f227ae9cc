"""`python -m frontend.main --worker-id fe-0 [--config cluster.yaml]`: the HTTP frontend under
hypercorn. Several frontend processes share the port (SO_REUSEPORT), so one event loop is not
the ceiling."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import tempfile

import zmq.asyncio
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from common.cpu_placement import place_light_process
from common.entrypoint import parse_args, secure_context, setup_logging

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 75.0  # idle connections kept open longer than clients' pools keep them (nginx: 75 s)


def listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock  # hypercorn takes it over (fd://) and closes it at shutdown


async def run(argv: list[str] | None = None) -> None:
    config, worker_id = parse_args("HTTP frontend", argv)
    setup_logging(worker_id)
    # prometheus_client reads this at import: the frontend processes of one port share the
    # directory the supervisor made (a lone frontend gets its own).
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="pdcluster-metrics-")
    from frontend.app import build_app
    from frontend.cluster_client import ClusterClient
    from frontend.model_info import load_model_info

    host, port = config.frontend.host, config.frontend.port
    # What /cluster_info lists: a wildcard bind (0.0.0.0) is no address anyone can dial
    url = f"http://{config.advertise_host or host}:{port}"
    context = zmq.asyncio.Context()
    authenticator = secure_context(context, config)
    client = ClusterClient(config, worker_id, url, context)
    app = build_app(config, client, load_model_info(config))
    place_light_process(config)  # off the engines' cores, once the start-up work is done
    sock = listening_socket(host, port)
    hypercorn_config = HypercornConfig()
    hypercorn_config.bind = [f"fd://{sock.fileno()}"]
    hypercorn_config.accesslog = None
    hypercorn_config.graceful_timeout = 3.0
    # A burst of clients connecting at once waits in the kernel's queue instead of being dropped.
    hypercorn_config.backlog = 2048
    # Clients pool idle connections and reuse them for up to their own expiry (httpx, so the openai
    # SDK: 5 s; aiohttp: 15 s). A server that closes first races the client's next request on
    # that connection, which then fails with no response: the server must outlast the clients.
    hypercorn_config.keep_alive_timeout = KEEP_ALIVE_S
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info("serving on %s/v1 (chunks at %s)", url, client.reply_to)
    try:
        await serve(app, hypercorn_config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        if authenticator is not None:
            authenticator.stop()
        context.term()
    logger.info("stopped")


def main(argv: list[str] | None = None) -> None:
    asyncio.run(run(argv))


if __name__ == "__main__":
    main()
