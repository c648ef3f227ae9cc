"""`python -m context_worker.main --worker-id ctx-0 [--config cluster.yaml]`"""

from __future__ import annotations

import logging

import zmq

from common.entrypoint import parse_args, setup_logging, stop_on_signals
from context_worker.worker import ContextWorker
from engine.serving import configure_torch

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    config, worker_id = parse_args("Context (prefill) worker", argv)
    setup_logging(worker_id)
    stop = stop_on_signals()
    configure_torch(config)
    context = zmq.Context()
    worker = ContextWorker(config, worker_id, context)
    try:
        if worker.link.register(stop) is None:
            return
        logger.info("registered with the orchestrator at %s", config.orchestrator.address)
        while not stop.is_set():
            worker.step()
    finally:
        worker.close()
        context.term()
    logger.info("stopped")


if __name__ == "__main__":
    main()
