"""One request's beam search: which beams live on, which hypotheses are done, when to stop.

The rules are transformers' `generate(num_beams=W)` (its vectorized beam search), so that the
two give the same hypotheses: each step, every live beam offers its best `keep` continuations
(token, cumulative log-prob), `keep = max(2, 1 + number of stop tokens) * W`; of the best
`keep` over all beams, a continuation that ends (a stop token, or max_tokens) and ranks in the
first W becomes a done hypothesis, scored sum_logprobs / generated_len ** length_penalty (the
best W kept); the first W that do not end are the next live beams.

The beams are ordinary sequences in the scheduler's batch. A beam that has produced its
continuations waits, parked with its blocks, until every live beam of its request has (a beam
can miss a step: the token budget, a preemption); then `select` decides, and the engine forks
the chosen parents' KV (engine/llm_engine.py). Plain data here; no tensors, no blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.sampling_params import BeamSearch

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class Continuation:
    parent: Sequence  # the beam it extends
    token_id: int
    score: float  # cumulative log-prob of the beam's output tokens and this one


@dataclass(slots=True, frozen=True)
class Hypothesis:
    token_ids: list[int]  # the output tokens, the stop token included
    score: float  # length-penalized
    finish_reason: str  # stop | length


@dataclass(slots=True)
class BeamGroup:
    params: BeamSearch
    num_results: int  # the request's n: the best n hypotheses are its choices
    max_tokens: int  # output tokens, the model's context included
    stop_token_ids: frozenset[int]
    live: list[Sequence] = field(default_factory=list)
    offers: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # seq_id -> best
    done: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # transformers' "early stop heuristic unsatisfied"
    finished: bool = False
    _next_id: int = 1  # for forked beams' sequence ids

    @property
    def width(self) -> int:
        return self.params.width

    @property
    def keep(self) -> int:
        """How many continuations each beam offers (and the step ranks): enough that `width`
        survive when stop tokens take some places."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def new_seq_id(self, request_id: str) -> str:
        self._next_id += 1
        return f"{request_id}#beam{self._next_id}"

    def offer(self, beam: Sequence, candidates: list[tuple[int, float]]) -> None:
        """A beam's best continuations: (token id, its log-prob given the beam)."""
        self.offers[beam.seq_id] = [(t, beam.beam_score + lp) for t, lp in candidates]

    def forget(self, beam: Sequence) -> None:
        """The beam lost its KV (preempted): it must compute its offer again."""
        self.offers.pop(beam.seq_id, None)

    @property
    def ready(self) -> bool:
        return all(beam.seq_id in self.offers for beam in self.live)

    def select(self) -> list[Continuation]:
        """One step: update the done hypotheses; return the next live beams, best first (none
        once the search is over: `finished`)."""
        ranked = sorted(
            (
                Continuation(beam, token_id, score)
                for beam in self.live
                for token_id, score in self.offers[beam.seq_id]
            ),
            key=lambda c: -c.score,
        )[: self.keep]  # a stable sort: ties keep beam order, then token order
        self.offers.clear()
        generated = len(self.live[0].output_token_ids) + 1  # every live beam has the same length
        ends = [self._ends(c.token_id, generated) for c in ranked]
        full = len(self.done) == self.width and self.params.early_stopping is True
        if self.improvable and not full:
            penalty = generated**self.params.length_penalty
            for c, ending in zip(ranked[: self.width], ends, strict=False):
                if ending:
                    reason = "stop" if c.token_id in self.stop_token_ids else "length"
                    tokens = [*c.parent.output_token_ids, c.token_id]
                    self.done.append(Hypothesis(tokens, c.score / penalty, reason))
            self.done.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
            del self.done[self.width :]
        survivors = [c for c, ending in zip(ranked, ends, strict=True) if not ending]
        survivors = survivors[: self.width]
        self._update_improvable(survivors, generated)
        self.finished = (
            not self.improvable
            or (len(self.done) == self.width and self.params.early_stopping is True)
            or not survivors
        )
        return [] if self.finished else survivors

    def results(self) -> list[Hypothesis]:
        return self.done[: self.num_results]

    def _ends(self, token_id: int, generated: int) -> bool:
        return token_id in self.stop_token_ids or generated >= self.max_tokens

    def _update_improvable(self, survivors: list[Continuation], generated: int) -> None:
        """Could the best live beam still beat the worst done hypothesis? Judged at its current
        length, or at max_tokens under "never" with a positive length penalty (where longer
        scores higher)."""
        if len(self.done) < self.width or not survivors:
            return
        penalty, early = self.params.length_penalty, self.params.early_stopping
        length = self.max_tokens if early == "never" and penalty > 0 else generated
        best_possible = survivors[0].score / length**penalty
        self.improvable = best_possible > min(h.score for h in self.done)
