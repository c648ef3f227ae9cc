"""`python -m postproc_worker.main --worker-id pp-0 [--config cluster.yaml]`"""

from __future__ import annotations

import logging
import os

import zmq

from common.builtin_models import resolve_model_dir
from common.config import ClusterConfig
from common.cpu_placement import place_light_process
from common.entrypoint import run_worker
from common.protocol import PROTOCOL_VERSION, Register
from common.tokenizer import load_tokenizer
from common.transport import bind_random_port, make_socket
from common.worker_process import WorkerProcess
from postproc_worker.worker import PostprocWorker

logger = logging.getLogger(__name__)


def make_process(
    config: ClusterConfig, worker_id: str, context: zmq.Context[zmq.Socket[bytes]]
) -> WorkerProcess:
    """The worker with its tokenizer and its sockets: TokenBatches come to its own PULL."""
    worker = PostprocWorker(load_tokenizer(resolve_model_dir(config.model, config.dtype)))
    place_light_process(config)  # off the engines' cores, once the start-up work is done
    tokens = make_socket(context, zmq.PULL)
    address = bind_random_port(
        tokens, config.internal_host, config.advertise_host, config.port_range
    )
    logger.info("receiving tokens at %s", address)
    register = Register(
        worker_id=worker_id,
        role="postproc",
        protocol_version=PROTOCOL_VERSION,
        pid=os.getpid(),
        address=address,
    )
    return WorkerProcess(context, config, worker, register, inputs=tokens)


def main(argv: list[str] | None = None) -> None:
    run_worker("Post-processing worker", make_process, argv)


if __name__ == "__main__":
    main()
