"""`python -m postproc_worker.main --worker-id pp-0 [--config cluster.yaml]`"""

from __future__ import annotations

from common.entrypoint import run_worker
from postproc_worker.worker import PostprocWorker


def main(argv: list[str] | None = None) -> None:
    run_worker("Post-processing worker", PostprocWorker, argv)


if __name__ == "__main__":
    main()
