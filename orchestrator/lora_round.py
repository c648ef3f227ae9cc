"""One /v1/load_lora_adapter or /v1/unload_lora_adapter in flight: a LoRACommand sent to every
live engine worker, their answers merged into the one LoRADone the asking frontend gets, and
the cluster's adapter table (what /v1/models lists) updated from the outcome.

As a profile round (profile_round.py): ends when every worker answered, at its deadline, or
earlier for a worker found dead; one round at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import LoRACommand, LoRADone

ANSWER_TIMEOUT_S = 120.0  # reading an adapter is seconds; a worker mid-step answers after it


@dataclass(slots=True)
class LoRARound:
    asker: bytes  # the frontend's ROUTER identity
    command: LoRACommand
    answer: LoRADone
    waiting: set[str]  # worker ids not yet answered
    deadline: float

    @classmethod
    def begin(
        cls, asker: bytes, command: LoRACommand, worker_ids: list[str], now: float
    ) -> LoRARound:
        answer = LoRADone(action=command.action, lora_name=command.lora_name)
        return cls(asker, command, answer, set(worker_ids), now + ANSWER_TIMEOUT_S)

    @property
    def complete(self) -> bool:
        return not self.waiting

    def on_answer(self, worker_id: str, done: LoRADone) -> None:
        if worker_id not in self.waiting or done.lora_name != self.command.lora_name:
            return  # late, from an earlier round, or a stranger
        self.waiting.discard(worker_id)
        self.answer.workers.extend(done.workers)
        self.answer.errors.extend(done.errors)

    def give_up_on(self, worker_id: str, why: str) -> None:
        if worker_id in self.waiting:
            self.waiting.discard(worker_id)
            self.answer.errors.append(f"{worker_id}: {why}")

    def expire(self, now: float) -> None:
        if now >= self.deadline:
            for worker_id in sorted(self.waiting):
                self.give_up_on(worker_id, f"no answer in {ANSWER_TIMEOUT_S:.0f} s")

    def apply(self, adapters: dict[str, str]) -> None:
        """The table after the round: a load counts once any worker has it (the others said
        why not), an unload once every worker dropped it."""
        name = self.command.lora_name
        if self.command.action == "load" and self.answer.workers:
            adapters[name] = self.command.lora_path
        elif self.command.action == "unload" and not self.answer.errors:
            adapters.pop(name, None)
