"""When did a message read now reach this process, at the latest? A lower bound, for KV leases.

A lease is a duration from the context worker (clocks on two hosts need not agree), so the reader
counts it from the earliest moment the hand-off could have reached it. The start of the previous
read of the socket bounds that, as long as the loop kept reading. When it did not (a long step, or
the whole process stopped: SIGSTOP, a VM pause), messages kept arriving meanwhile, but its ZeroMQ
I/O thread stopped too, and hands them over only during the first reads after the pause; a message
read then may have waited the whole pause. So for `catch_up_s` after a gap of more than `gap_s`
between reads, the bound is the read before the gap: such leases look older than they may be, and
are prefilled here rather than read from blocks their source may have freed.
"""

from __future__ import annotations

import math


class ArrivalBound:
    def __init__(self, now: float, gap_s: float = 0.5, catch_up_s: float = 1.0) -> None:
        self.gap_s, self.catch_up_s = gap_s, catch_up_s
        self._read_at = now  # when the previous read began
        self._before_gap = now  # the read before the last gap
        self._catch_up_until = -math.inf

    def read(self, now: float) -> float:
        """A read of the socket begins at `now`: what it returns arrived no earlier than this
        says (and no later than `now`)."""
        if now - self._read_at > self.gap_s:
            self._before_gap, self._catch_up_until = self._read_at, now + self.catch_up_s
        bound = self._before_gap if now < self._catch_up_until else self._read_at
        self._read_at = now
        return bound
