"""One /v1/load_lora_adapter or /v1/unload_lora_adapter in flight: a LoRACommand sent to every
live engine worker, their answers merged into the one LoRADone the asking frontend gets
(worker_round.py), and the cluster's adapter table (what /v1/models lists) updated from the
outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import LoRACommand, LoRADone
from orchestrator.worker_round import WorkerRound

ANSWER_TIMEOUT_S = 120.0  # reading an adapter is seconds; a worker mid-step answers after it


@dataclass(slots=True)
class LoRARound(WorkerRound[LoRADone]):
    command: LoRACommand

    @classmethod
    def begin(
        cls, asker: bytes, command: LoRACommand, worker_ids: list[str], now: float
    ) -> LoRARound:
        answer = LoRADone(action=command.action, lora_name=command.lora_name)
        deadline = now + ANSWER_TIMEOUT_S
        return cls(asker, answer, set(worker_ids), deadline, ANSWER_TIMEOUT_S, command)

    def on_answer(self, worker_id: str, done: LoRADone) -> None:
        if done.lora_name == self.answer.lora_name and self.answered(worker_id):
            self.answer.workers.extend(done.workers)
            self.answer.errors.extend(done.errors)

    def apply(self, adapters: dict[str, str]) -> None:
        """The table after the round: a load counts once any worker has it (the others said
        why not), an unload once every worker dropped it."""
        name = self.command.lora_name
        if self.command.action == "load" and self.answer.workers:
            adapters[name] = self.command.lora_path
        elif self.command.action == "unload" and not self.answer.errors:
            adapters.pop(name, None)
