"""Stored responses (`store: true`): for GET / DELETE /v1/responses/{id} and for
`previous_response_id`, which continues the conversation a stored response ended.

Each stored response keeps the Response JSON as sent, and the conversation as chat turns (the
request's turns, then the response's output as an assistant turn), which is what a follow-up
request is rendered from. Two backends behind one contract (put / get / delete), chosen by
`frontend.responses_store`:

    a file path        SQLite, one file per host, shared by the host's frontend processes (WAL;
                       a connection per operation, run off the event loop)
    redis://host:port  Redis, for frontends on several hosts (a key per response)
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Protocol

import msgspec
import redis

from common.responses_schema import FunctionCallItem, MessageItem, ReasoningItem, Response

Turns = list[dict[str, Any]]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response BLOB NOT NULL,   -- the Response JSON as the client got it
    turns TEXT NOT NULL       -- the conversation as chat turns, output included
)
"""
REDIS_PREFIX = "pdcluster:response:"


class ResponseStore(Protocol):
    def put(self, body: bytes, turns: Turns) -> None:
        """Store a finished response; `turns`: the conversation that made it (its input)."""

    def get(self, response_id: str) -> tuple[bytes, Turns] | None:
        """(the Response JSON, the conversation with its output), or None."""

    def delete(self, response_id: str) -> bool: ...


def open_store(location: str) -> ResponseStore:
    if location.startswith(("redis://", "rediss://")):
        return RedisStore(location)
    return SqliteStore(location)


def conversation(body: bytes, turns: Turns) -> tuple[str, str]:
    """(the response id, the conversation it ends as JSON): `turns` and the output as an
    assistant turn, its reasoning items as the turn's reasoning_content (a harmony model renders
    them while the turn's calls are being answered; responses.as_chat_request drops them for the
    others, as it drops reasoning input items)."""
    response = msgspec.json.decode(body, type=Response)
    text = "".join(
        part.text for item in response.output if isinstance(item, MessageItem)
        for part in item.content
    )  # fmt: skip
    reasoning = "\n".join(
        "".join(part.text for part in item.content)
        for item in response.output if isinstance(item, ReasoningItem)
    )  # fmt: skip
    calls = [
        {"id": item.call_id, "type": "function",
         "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning:
        turn["reasoning_content"] = reasoning
    if calls:
        turn["tool_calls"] = calls
    return response.id, json.dumps([*turns, turn])


def prepare_sqlite(path: str, schema: tuple[str, ...]) -> Path:
    """The store's file, created with its tables if new, in WAL mode (the host's frontend
    processes read and write it at once). The stored responses and the message batches share
    one file."""
    file = Path(path).expanduser()
    file.parent.mkdir(parents=True, exist_ok=True)
    with closing(connect_sqlite(file)) as db, db:
        db.execute("PRAGMA journal_mode=WAL")
        for statement in schema:
            db.execute(statement)
    return file


def connect_sqlite(file: Path) -> sqlite3.Connection:
    return sqlite3.connect(file, timeout=10)


class SqliteStore:
    def __init__(self, path: str) -> None:
        self.path = prepare_sqlite(path, (_SCHEMA,))

    def _connect(self) -> sqlite3.Connection:
        return connect_sqlite(self.path)

    def put(self, body: bytes, turns: Turns) -> None:
        response_id, turns_json = conversation(body, turns)
        with closing(self._connect()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (response_id, int(time.time()), body, turns_json),
            )

    def get(self, response_id: str) -> tuple[bytes, Turns] | None:
        with closing(self._connect()) as db:
            row = db.execute(
                "SELECT response, turns FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return None if row is None else (bytes(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with closing(self._connect()) as db, db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0


class RedisStore:
    """A hash per response (fields `response`, `turns`); the client pools its connections."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=10)

    def put(self, body: bytes, turns: Turns) -> None:
        response_id, turns_json = conversation(body, turns)
        self.client.hset(
            REDIS_PREFIX + response_id, mapping={"response": body, "turns": turns_json}
        )

    def get(self, response_id: str) -> tuple[bytes, Turns] | None:
        body, turns = self.client.hmget(REDIS_PREFIX + response_id, ["response", "turns"])
        if not isinstance(body, bytes) or not isinstance(turns, bytes):
            return None
        return body, json.loads(turns)

    def delete(self, response_id: str) -> bool:
        return bool(self.client.delete(REDIS_PREFIX + response_id))
