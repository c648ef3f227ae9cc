"""`python -m context_worker.main --worker-id ctx-0 [--config cluster.yaml]`"""

from __future__ import annotations

import os

import zmq

from common.config import ClusterConfig
from common.entrypoint import run_worker
from common.protocol import PROTOCOL_VERSION, Register
from common.worker_process import WorkerProcess
from context_worker.worker import ContextWorker
from engine.kv_tier_share import TierShare
from engine.worker_bridge import build_engine, kv_event_publisher


def make_process(config: ClusterConfig, worker_id: str, context: zmq.Context) -> WorkerProcess:
    """The worker with its engine, its NIXL agent and its sockets."""
    engine, agent = build_engine(config, worker_id, config.context_workers)
    # registered with NIXL before agent.info(): the registration's metadata must cover it
    offload = engine.kv.offload
    tier_share = TierShare(agent, offload) if offload is not None else None
    events = kv_event_publisher(config, worker_id, context)
    worker = ContextWorker(config, worker_id, engine, agent, tier_share=tier_share)
    register = Register(
        worker_id=worker_id,
        role="context",
        num_blocks=config.kv_cache.num_blocks,
        events_address=events.endpoint if events is not None else "",
        protocol_version=PROTOCOL_VERSION,
        pid=os.getpid(),
        kv_pool=agent.info(),
    )
    return WorkerProcess(context, config, worker, register, events=events)


def main(argv: list[str] | None = None) -> None:
    run_worker("Context (prefill) worker", make_process, argv)


if __name__ == "__main__":
    main()
