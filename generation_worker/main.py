"""`python -m generation_worker.main --worker-id gen-0 [--config cluster.yaml]`"""

from __future__ import annotations

import logging

import zmq

from common.entrypoint import parse_args, setup_logging, stop_on_signals
from engine.serving import configure_torch
from generation_worker.worker import GenerationWorker

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    config, worker_id = parse_args("Generation (decode) worker", argv)
    setup_logging(worker_id)
    stop = stop_on_signals()
    configure_torch(config)
    context = zmq.Context()
    worker = GenerationWorker(config, worker_id, context)
    try:
        registered = worker.link.register(stop)
        if registered is None:
            return
        worker.sync_peers(registered.peers)
        logger.info("registered with the orchestrator at %s", config.orchestrator.address)
        while not stop.is_set():
            worker.step()
    finally:
        worker.close()
        context.term()
    logger.info("stopped")


if __name__ == "__main__":
    main()
