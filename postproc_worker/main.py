"""`python -m postproc_worker.main --worker-id pp-0 [--config cluster.yaml]`"""

from __future__ import annotations

import logging

import zmq

from common.entrypoint import parse_args, setup_logging, stop_on_signals
from postproc_worker.worker import PostprocWorker

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    config, worker_id = parse_args("Post-processing worker", argv)
    setup_logging(worker_id)
    stop = stop_on_signals()
    context = zmq.Context()
    worker = PostprocWorker(config, worker_id, context)
    try:
        if worker.link.register(stop) is None:
            return
        logger.info("registered; receiving tokens at %s", worker.address)
        while not stop.is_set():
            worker.step()
    finally:
        worker.close()
        context.term()
    logger.info("stopped")


if __name__ == "__main__":
    main()
