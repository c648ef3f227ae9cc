"""A thinking budget, kept token by token: where the output is (inside a thinking block or not),
how much thinking it has spent, and the end marker's tokens still to force once it is spent.

The state is a function of the output tokens alone, fed in order through `append`: a generation
worker that replays the context worker's first token arrives at the same state, so the budget
holds across the prefill / decode hand-off, and across a preemption's recompute (the sequence
keeps its SamplingState). Markers are matched on the token ids the frontend gave
(`common.sampling_params.ThinkingBudget`).
"""

from __future__ import annotations

from common.sampling_params import ThinkingBudget


class ThinkingTracker:
    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self.inside = budget.open_at_start
        self.spent = 0
        self.recent: list[int] = []  # the last tokens, as long as the longer marker
        self.to_force: list[int] = []  # the end marker's tokens not yet emitted
        self._window = max(len(budget.start), len(budget.end))
        if self.inside and budget.tokens == 0:
            self.to_force = list(budget.end)

    def forced_token(self) -> int | None:
        """The token the next step must produce, or None when the model is free."""
        return self.to_force[0] if self.to_force else None

    def append(self, token_id: int) -> None:
        if self.to_force and token_id == self.to_force[0]:
            self.to_force.pop(0)
        self.recent = (self.recent + [token_id])[-self._window :]
        if not self.inside:
            if self._ends_with(self.budget.start):
                self.inside = True
                self._force_if_spent()
            return
        if self._ends_with(self.budget.end):
            self.inside = False
            self.to_force = []
            self.spent -= len(self.budget.end) - 1  # the marker's first tokens were counted
            return
        self.spent += 1
        self._force_if_spent()

    def _force_if_spent(self) -> None:
        if self.inside and self.spent >= self.budget.tokens and not self.to_force:
            self.to_force = list(self.budget.end)

    def _ends_with(self, marker: list[int]) -> bool:
        return len(self.recent) >= len(marker) and self.recent[-len(marker) :] == marker
