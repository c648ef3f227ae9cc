"""Context worker leases: released once, expired by deadline in order."""

from __future__ import annotations

from context_worker.leases import LeaseTable


def test_release_ends_a_lease_once() -> None:
    leases = LeaseTable(lease_s=30.0)
    leases.add("a", now=0.0)
    assert "a" in leases and len(leases) == 1
    assert leases.release("a")
    assert not leases.release("a")
    assert leases.expired(now=100.0) == []


def test_expiry_ends_only_leases_past_their_deadline() -> None:
    leases = LeaseTable(lease_s=10.0)
    leases.add("a", now=0.0)
    leases.add("b", now=5.0)
    leases.add("c", now=9.0)
    assert leases.expired(now=15.0) == ["a", "b"]
    assert list(leases.expired(now=15.0)) == []
    assert "c" in leases
    leases.add("c", now=20.0)  # renewed: the deadline moves
    assert leases.expired(now=25.0) == []
