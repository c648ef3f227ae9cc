"""Which side of a disaggregated cluster is its bottleneck, from the time requests spend on each:
what max_prefill_queue_size "auto" deflects on (orchestrator.py's context_backlogged).

By Little's law the requests a side holds are its arrival rate times the time a request spends
there, and requests pile up in front of the slower side: where a request waits for its first
token (queued at and prefilled by a context worker) clearly longer than its decode then takes
(from the hand-off to its last token), the context workers are the bottleneck and the generation
workers have room, so a prompt the context workers would queue starts sooner beside the
generation workers' decodes. Where the two times are close, both sides are near their limits,
and a deflected prompt's prefill, which stalls every decode of its generation worker for its
length, costs more than it frees.

The thresholds come from the bench runs that measured deflection (bench/README.md; the first
token's p50 wait against the decode's, without deflection): it paid where the wait was 1.7x
the decode (Llama-3.2-1B at 32 clients on the Xeon host: 58 s against 35; +11 %) and 4x
(Qwen3-0.6B and Llama-3.2-1B at 8 on the Zen 4 VM: 35 and 69 s against 9 and 16; +10 % and
1.25 -> 1.65x vLLM), and cost where it was about 1x (SmolLM2 at 32 on the Zen 4 VM, by the
orchestrator's own averages 4.2-5.3 s against 4.2-5.4: by our estimate a context worker 90 %
busy beside a generation worker 80 % busy; 9-12 %) and 0.15x (Qwen3-0.6B at 32 on the Xeon
host: 9 s against 61; 12 %). So deflection starts past START_RATIO and, once deflected prompts
have shortened the waits and lengthened the decodes, stops below STOP_RATIO: between the two the
verdict holds, so that it does not flip on every request near the crossing.

The two times are running averages over requests, not the requests each side holds at the
moment: in a closed loop of clients whose requests finish together (the same output length),
each wave of new prompts briefly outnumbers the decodes left.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

WEIGHT = 1 / 16  # of each new request in the averages: about the last 16 requests count
START_RATIO = 1.5  # first-token wait over decode time past which deflection starts ...
STOP_RATIO = 1.0  # ... and below which it stops


class StageBalance:
    def __init__(self) -> None:
        self.first_token_s: float | None = None  # received -> first token, context-prefilled
        self.decode_s: float | None = None  # hand-off -> finished
        self._context_bound = False

    def prefilled(self, first_token_s: float) -> None:
        """A context worker's prompt got its first token this long after the cluster got it."""
        self.first_token_s = _averaged(self.first_token_s, first_token_s)
        self._judge()

    def decoded(self, decode_s: float) -> None:
        """A handed-off request finished this long after its hand-off."""
        self.decode_s = _averaged(self.decode_s, decode_s)
        self._judge()

    def context_bound(self) -> bool:
        """Requests wait START_RATIO times longer for their first token than they take to
        decode, or did and still wait STOP_RATIO times longer (False until both times have
        been measured)."""
        return self._context_bound

    def _judge(self) -> None:
        if self.first_token_s is None or self.decode_s is None:
            return
        ratio = STOP_RATIO if self._context_bound else START_RATIO
        bound = self.first_token_s > ratio * self.decode_s
        if bound != self._context_bound:
            logger.info(
                "first tokens wait %.2f s on average, decodes take %.2f s: the context "
                "workers are %s the bottleneck",
                self.first_token_s,
                self.decode_s,
                "now" if bound else "no longer",
            )
        self._context_bound = bound


def _averaged(average: float | None, sample: float) -> float:
    return sample if average is None else average + WEIGHT * (sample - average)
