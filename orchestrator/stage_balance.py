"""Which side of a disaggregated cluster is its bottleneck, from the time requests spend on each:
what max_prefill_queue_size "auto" deflects on (orchestrator.py's context_backlogged).

By Little's law the requests a side holds are its arrival rate times the time a request spends
there, and requests pile up in front of the slower side: where a request waits for its first
token (queued at and prefilled by a context worker) longer than its decode then takes (from the
hand-off to its last token), the context workers are the bottleneck and a prompt they would
queue starts sooner beside the generation workers' decodes. In the bench runs that measured
deflection (bench/README.md) the cells where it paid were of that kind (Llama-3.2-1B at 32
clients on the Xeon host: 58 s to the first token against 35 s of decode; Qwen3-0.6B and
Llama-3.2-1B at 8 on the Zen 4 VM: 35 and 69 s against 9 and 16), and those where it cost the
reverse (Qwen3-0.6B at 32 on the Xeon host: 9 s against 61; SmolLM2 at 32 on the Zen 4 VM: 3-4
s against 7).

The two times are running averages over requests, not the requests each side holds at the
moment: in a closed loop of clients whose requests finish together (the same output length),
each wave of new prompts briefly outnumbered the decodes left, and deflecting on those counts
cost SmolLM2 at 32 clients 9-12 % of its throughput in a run where the context side was never
the bottleneck.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

WEIGHT = 1 / 16  # of each new request in the averages: about the last 16 requests count


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
        """Requests wait longer for their first token than they take to decode (False until
        both have been measured)."""
        return self._context_bound

    def _judge(self) -> None:
        if self.first_token_s is None or self.decode_s is None:
            return
        bound = self.first_token_s > self.decode_s
        if bound != self._context_bound:
            logger.info(
                "first tokens wait %.2f s on average, decodes take %.2f s: prompts %s",
                self.first_token_s,
                self.decode_s,
                "may be prefilled by generation workers"
                if bound
                else "queue at the context workers",
            )
        self._context_bound = bound


def _averaged(average: float | None, sample: float) -> float:
    return sample if average is None else average + WEIGHT * (sample - average)
