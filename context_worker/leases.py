"""Leases on the KV blocks of prefilled requests, waiting for a generation worker to read them.

    PrefillDone sent ──▶ leased ──NIXL notification (read done)──▶ released: blocks freed
                            ├──Abort from the orchestrator──────────▶ released
                            └──lease_s passed (reader died or gave up)▶ expired: blocks freed

Every lease lasts the same `lease_s`, so deadlines grow in insertion order and expiry only ever
looks at the oldest leases.
"""

from __future__ import annotations


class LeaseTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._deadlines: dict[str, float] = {}  # request id -> deadline, oldest first

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deadlines

    def add(self, request_id: str, now: float) -> None:
        self._deadlines.pop(request_id, None)
        self._deadlines[request_id] = now + self.lease_s

    def release(self, request_id: str) -> bool:
        """End a lease; False if there was none (already released, expired, or never leased)."""
        return self._deadlines.pop(request_id, None) is not None

    def expired(self, now: float) -> list[str]:
        """End and return the leases whose deadline passed."""
        ended = []
        for request_id, deadline in self._deadlines.items():
            if deadline > now:
                break
            ended.append(request_id)
        for request_id in ended:
            del self._deadlines[request_id]
        return ended
