"""`python -m context_worker.main --worker-id ctx-0 [--config cluster.yaml]`"""

from __future__ import annotations

from common.entrypoint import run_worker
from context_worker.worker import ContextWorker


def main(argv: list[str] | None = None) -> None:
    run_worker("Context (prefill) worker", ContextWorker, argv)


if __name__ == "__main__":
    main()
