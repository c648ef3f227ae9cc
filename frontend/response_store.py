"""Stored responses (`store: true`): for GET / DELETE /v1/responses/{id} and for
`previous_response_id`, which continues the conversation a stored response ended.

One SQLite database per host (`frontend.responses_store`), shared by all frontend processes of
the host (WAL mode; a connection per operation, run off the event loop). Each row keeps the
Response JSON as sent, and the conversation as chat turns (the request's turns, then the
response's output as an assistant turn), which is what a follow-up request is rendered from.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec

from common.responses_schema import FunctionCallItem, MessageItem, Response

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response BLOB NOT NULL,   -- the Response JSON as the client got it
    turns TEXT NOT NULL       -- the conversation as chat turns, output included
)
"""


def output_turns(response: Response) -> list[dict[str, Any]]:
    """The response's output as the assistant turn a follow-up request starts from."""
    text = "".join(
        part.text for item in response.output if isinstance(item, MessageItem)
        for part in item.content
    )  # fmt: skip
    calls = [
        {"id": item.call_id, "type": "function",
         "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


class ResponseStore:
    def __init__(self, path: str) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db, db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10)

    def put(self, body: bytes, turns: list[dict[str, Any]]) -> None:
        """Store a finished response; `turns`: the conversation that made it (its input)."""
        response = msgspec.json.decode(body, type=Response)
        conversation = json.dumps([*turns, *output_turns(response)])
        with closing(self._connect()) as db, db:
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                (response.id, int(time.time()), body, conversation),
            )

    def get(self, response_id: str) -> tuple[bytes, list[dict[str, Any]]] | None:
        with closing(self._connect()) as db:
            row = db.execute(
                "SELECT response, turns FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return None if row is None else (bytes(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with closing(self._connect()) as db, db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
