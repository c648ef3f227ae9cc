"""Anthropic Message Batches' state, kept beside the stored responses (`frontend.responses_store`):
the same SQLite file or the same Redis, so every frontend process (and host) answers for every
batch, whichever process runs it.

A batch is its requests (custom id and Messages params, in order), one result per request once
it has one, and three instants: created, cancel asked for, ended. What the API shows
(processing_status, request_counts) is derived from those when read (message_batches.py).

    SQLite   message_batches (one row per batch), message_batch_items (one per request)
    Redis    pdcluster:batch:<id> (a hash), pdcluster:batch:<id>:items (a list of requests),
             pdcluster:batch:<id>:results (a hash position → result), pdcluster:batches (a
             sorted set of ids by creation time, for listing)
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol

import redis

from frontend.response_store import connect_sqlite, prepare_sqlite

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS message_batches (
        id TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        cancel_initiated_at REAL,
        ended_at REAL
    )""",
    """CREATE TABLE IF NOT EXISTS message_batch_items (
        batch_id TEXT NOT NULL,
        position INTEGER NOT NULL,
        custom_id TEXT NOT NULL,
        params BLOB NOT NULL,  -- the request's Messages params, JSON
        result BLOB,           -- its result object, JSON; NULL while processing
        PRIMARY KEY (batch_id, position)
    )""",
)
REDIS_PREFIX = "pdcluster:batch:"
REDIS_INDEX = "pdcluster:batches"


@dataclass(slots=True)
class BatchRecord:
    id: str
    created_at: float  # time.time() of the frontend that created it
    cancel_initiated_at: float | None
    ended_at: float | None
    results: list[bytes | None]  # per request, in order: its result JSON, or None (processing)


class BatchStore(Protocol):
    def create(self, batch_id: str, created_at: float, items: list[tuple[str, bytes]]) -> None:
        """A new batch of (custom id, params JSON) requests."""

    def params(self, batch_id: str) -> list[tuple[str, bytes]]: ...

    def put_result(self, batch_id: str, position: int, result: bytes) -> None: ...

    def get(self, batch_id: str) -> BatchRecord | None: ...

    def ids(self) -> list[str]:
        """Every batch's id, newest first."""

    def cancel(self, batch_id: str, at: float) -> None:
        """Record a cancellation request (once; later ones change nothing)."""

    def cancel_requested(self, batch_id: str) -> bool:
        """Whether a cancel was asked for (or the batch is gone): what its runner polls."""

    def end(self, batch_id: str, at: float) -> None: ...

    def delete(self, batch_id: str) -> None: ...


def open_batch_store(location: str) -> BatchStore:
    if location.startswith(("redis://", "rediss://")):
        return RedisBatchStore(location)
    return SqliteBatchStore(location)


class SqliteBatchStore:
    def __init__(self, path: str) -> None:
        self.path = prepare_sqlite(path, _SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return connect_sqlite(self.path)

    def create(self, batch_id: str, created_at: float, items: list[tuple[str, bytes]]) -> None:
        with closing(self._connect()) as db, db:
            db.execute(
                "INSERT INTO message_batches VALUES (?, ?, NULL, NULL)", (batch_id, created_at)
            )
            db.executemany(
                "INSERT INTO message_batch_items VALUES (?, ?, ?, ?, NULL)",
                [(batch_id, i, custom_id, params) for i, (custom_id, params) in enumerate(items)],
            )

    def params(self, batch_id: str) -> list[tuple[str, bytes]]:
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT custom_id, params FROM message_batch_items WHERE batch_id = ? "
                "ORDER BY position",
                (batch_id,),
            ).fetchall()
        return [(custom_id, bytes(params)) for custom_id, params in rows]

    def put_result(self, batch_id: str, position: int, result: bytes) -> None:
        with closing(self._connect()) as db, db:
            db.execute(
                "UPDATE message_batch_items SET result = ? WHERE batch_id = ? AND position = ?",
                (result, batch_id, position),
            )

    def get(self, batch_id: str) -> BatchRecord | None:
        with closing(self._connect()) as db:
            row = db.execute(
                "SELECT created_at, cancel_initiated_at, ended_at FROM message_batches "
                "WHERE id = ?",
                (batch_id,),
            ).fetchone()
            if row is None:
                return None
            results = db.execute(
                "SELECT result FROM message_batch_items WHERE batch_id = ? ORDER BY position",
                (batch_id,),
            ).fetchall()
        created_at, cancel_initiated_at, ended_at = row
        return BatchRecord(
            batch_id,
            created_at,
            cancel_initiated_at,
            ended_at,
            [None if r is None else bytes(r) for (r,) in results],
        )

    def ids(self) -> list[str]:
        with closing(self._connect()) as db:
            rows = db.execute("SELECT id FROM message_batches ORDER BY created_at DESC").fetchall()
        return [batch_id for (batch_id,) in rows]

    def cancel(self, batch_id: str, at: float) -> None:
        with closing(self._connect()) as db, db:
            db.execute(
                "UPDATE message_batches SET cancel_initiated_at = ? "
                "WHERE id = ? AND cancel_initiated_at IS NULL",
                (at, batch_id),
            )

    def cancel_requested(self, batch_id: str) -> bool:
        with closing(self._connect()) as db:
            row = db.execute(
                "SELECT cancel_initiated_at FROM message_batches WHERE id = ?", (batch_id,)
            ).fetchone()
        return row is None or row[0] is not None

    def end(self, batch_id: str, at: float) -> None:
        with closing(self._connect()) as db, db:
            db.execute("UPDATE message_batches SET ended_at = ? WHERE id = ?", (at, batch_id))

    def delete(self, batch_id: str) -> None:
        with closing(self._connect()) as db, db:
            db.execute("DELETE FROM message_batch_items WHERE batch_id = ?", (batch_id,))
            db.execute("DELETE FROM message_batches WHERE id = ?", (batch_id,))


class RedisBatchStore:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=10)

    def create(self, batch_id: str, created_at: float, items: list[tuple[str, bytes]]) -> None:
        key = REDIS_PREFIX + batch_id
        with self.client.pipeline() as pipe:
            pipe.hset(key, mapping={"created_at": created_at, "size": len(items)})
            pipe.rpush(key + ":items", *[json.dumps([c, p.decode()]) for c, p in items])
            pipe.zadd(REDIS_INDEX, {batch_id: created_at})
            pipe.execute()

    def params(self, batch_id: str) -> list[tuple[str, bytes]]:
        items = self.client.lrange(REDIS_PREFIX + batch_id + ":items", 0, -1)
        return [(c, p.encode()) for c, p in (json.loads(i) for i in items)]  # type: ignore[union-attr]

    def put_result(self, batch_id: str, position: int, result: bytes) -> None:
        self.client.hset(REDIS_PREFIX + batch_id + ":results", str(position), result)

    def get(self, batch_id: str) -> BatchRecord | None:
        key = REDIS_PREFIX + batch_id
        fields = self.client.hgetall(key)
        if not fields:
            return None
        stored = self.client.hgetall(key + ":results")
        size = int(fields[b"size"])  # type: ignore[index]
        results = [stored.get(str(i).encode()) for i in range(size)]  # type: ignore[union-attr]

        def instant(name: bytes) -> float | None:
            value = fields.get(name)  # type: ignore[union-attr]
            return None if value is None else float(value)

        return BatchRecord(
            batch_id,
            float(fields[b"created_at"]),  # type: ignore[index]
            instant(b"cancel_initiated_at"),
            instant(b"ended_at"),
            results,  # type: ignore[arg-type]
        )

    def ids(self) -> list[str]:
        return [i.decode() for i in self.client.zrevrange(REDIS_INDEX, 0, -1)]  # type: ignore[union-attr]

    def cancel(self, batch_id: str, at: float) -> None:
        self.client.hsetnx(REDIS_PREFIX + batch_id, "cancel_initiated_at", at)

    def cancel_requested(self, batch_id: str) -> bool:
        key = REDIS_PREFIX + batch_id
        created, canceled = self.client.hmget(key, ["created_at", "cancel_initiated_at"])
        return created is None or canceled is not None

    def end(self, batch_id: str, at: float) -> None:
        self.client.hset(REDIS_PREFIX + batch_id, "ended_at", at)

    def delete(self, batch_id: str) -> None:
        key = REDIS_PREFIX + batch_id
        self.client.delete(key, key + ":items", key + ":results")
        self.client.zrem(REDIS_INDEX, batch_id)
