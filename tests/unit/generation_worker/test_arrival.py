"""The lower bound on a message's arrival that KV leases are counted from."""

from __future__ import annotations

from generation_worker.arrival import ArrivalBound


def test_a_loop_that_keeps_reading_bounds_arrival_by_its_previous_read() -> None:
    bound = ArrivalBound(0.0)
    assert [bound.read(t) for t in (0.01, 0.02, 0.3)] == [0.0, 0.01, 0.02]


def test_after_a_pause_reads_for_a_while_are_bounded_by_the_read_before_it() -> None:
    """Stopped 20 s after the read at 1.0: what the first reads after it return may have queued
    all that time (the I/O thread was stopped too); then the bound follows the reads again."""
    bound = ArrivalBound(0.0)
    bound.read(1.0)
    after = [bound.read(t) for t in (21.0, 21.01, 21.5, 21.99)]
    assert after == [1.0, 1.0, 1.0, 1.0]
    assert bound.read(22.1) == 21.99
