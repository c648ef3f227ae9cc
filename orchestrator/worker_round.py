"""A command fanned out to every live engine worker, whose answers merge into the one answer the
asking frontend gets: /start_profile and /stop_profile (profile_round.py), /v1/load_lora_adapter
and /v1/unload_lora_adapter (lora_round.py).

A round ends when every worker answered, at its deadline, or earlier for a worker found dead
(`give_up_on`): either way the frontend is answered, its `errors` naming each worker that did
not. One round of a kind at a time; another command meanwhile is answered at once with an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Answer(Protocol):
    errors: list[str]


A = TypeVar("A", bound=Answer)


@dataclass(slots=True)
class WorkerRound(Generic[A]):
    asker: bytes  # the frontend's ROUTER identity
    answer: A
    waiting: set[str]  # worker ids not yet answered
    deadline: float
    timeout_s: float

    @property
    def complete(self) -> bool:
        return not self.waiting

    def answered(self, worker_id: str) -> bool:
        """Take `worker_id`'s answer: False, ignoring it, when late, from an earlier round or
        from a stranger."""
        if worker_id not in self.waiting:
            return False
        self.waiting.discard(worker_id)
        return True

    def give_up_on(self, worker_id: str, why: str) -> None:
        if worker_id in self.waiting:
            self.waiting.discard(worker_id)
            self.answer.errors.append(f"{worker_id}: {why}")

    def expire(self, now: float) -> None:
        if now >= self.deadline:
            for worker_id in sorted(self.waiting):
                self.give_up_on(worker_id, f"no answer in {self.timeout_s:.0f} s")
