"""`python -m generation_worker.main --worker-id gen-0 [--config cluster.yaml]`"""

from __future__ import annotations

from common.entrypoint import run_worker
from generation_worker.worker import GenerationWorker


def main(argv: list[str] | None = None) -> None:
    run_worker("Generation (decode) worker", GenerationWorker, argv)


if __name__ == "__main__":
    main()
