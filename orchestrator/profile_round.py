"""One /start_profile or /stop_profile in flight: a `Profile` sent to every live engine worker,
and their answers merged into the one `ProfileDone` the asking frontend gets.

The round ends when every worker answered, or at its deadline (a stop writes a trace, which
takes seconds on a long session), or earlier for a worker found dead: either way the frontend is
answered, naming each worker that did not. One round at a time; another command meanwhile is
answered at once with an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import PROFILE_ANSWER_TIMEOUT_S as ANSWER_TIMEOUT_S
from common.protocol import Profile, ProfileDone


@dataclass(slots=True)
class ProfileRound:
    asker: bytes  # the frontend's ROUTER identity
    answer: ProfileDone
    waiting: set[str]  # worker ids not yet answered
    deadline: float

    @classmethod
    def begin(
        cls, asker: bytes, command: Profile, worker_ids: list[str], now: float
    ) -> ProfileRound:
        deadline = now + ANSWER_TIMEOUT_S
        return cls(asker, ProfileDone(action=command.action), set(worker_ids), deadline)

    @property
    def complete(self) -> bool:
        return not self.waiting

    def on_answer(self, worker_id: str, done: ProfileDone) -> None:
        if worker_id not in self.waiting:
            return  # late, from an earlier round, or a stranger
        self.waiting.discard(worker_id)
        self.answer.workers.extend(done.workers)
        self.answer.files.extend(done.files)
        self.answer.errors.extend(done.errors)

    def give_up_on(self, worker_id: str, why: str) -> None:
        if worker_id in self.waiting:
            self.waiting.discard(worker_id)
            self.answer.errors.append(f"{worker_id}: {why}")

    def expire(self, now: float) -> None:
        if now >= self.deadline:
            for worker_id in sorted(self.waiting):
                self.give_up_on(worker_id, f"no answer in {ANSWER_TIMEOUT_S:.0f} s")
