"""One /start_profile or /stop_profile in flight: a `Profile` sent to every live engine worker,
and their answers merged into the one `ProfileDone` the asking frontend gets (worker_round.py).
Its deadline allows for a stop writing a trace, which takes seconds on a long session.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import PROFILE_ANSWER_TIMEOUT_S as ANSWER_TIMEOUT_S
from common.protocol import Profile, ProfileDone
from orchestrator.worker_round import WorkerRound


@dataclass(slots=True)
class ProfileRound(WorkerRound[ProfileDone]):
    @classmethod
    def begin(
        cls, asker: bytes, command: Profile, worker_ids: list[str], now: float
    ) -> ProfileRound:
        answer = ProfileDone(action=command.action)
        return cls(asker, answer, set(worker_ids), now + ANSWER_TIMEOUT_S, ANSWER_TIMEOUT_S)

    def on_answer(self, worker_id: str, done: ProfileDone) -> None:
        if self.answered(worker_id):
            self.answer.workers.extend(done.workers)
            self.answer.files.extend(done.files)
            self.answer.errors.extend(done.errors)
