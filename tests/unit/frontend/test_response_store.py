"""Stored responses, in both backends (SQLite, and a real redis-server): a response and its
conversation come back as stored, output as the assistant's turn, and go away when deleted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from common.responses_schema import (
    FunctionCallItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
)
from frontend.response_store import ResponseStore, open_store
from tests.redis_server import redis_server


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ResponseStore]:
    if request.param == "sqlite":
        yield open_store(str(tmp_path / "responses.sqlite3"))
    else:
        with redis_server() as url:
            yield open_store(url)


def test_a_stored_response_comes_back_with_its_conversation(store: ResponseStore) -> None:
    response = Response(id="resp_1", created_at=1, model="m", output=[
        MessageItem(id="msg_1", content=[OutputText(text="Let me check.")]),
        FunctionCallItem(id="fc_1", call_id="call_1", name="f", arguments='{"x": 1}'),
    ])  # fmt: skip
    body = msgspec.json.encode(response)
    store.put(body, [{"role": "user", "content": "Check x."}])
    stored = store.get("resp_1")
    assert stored is not None and stored[0] == body
    assert stored[1] == [
        {"role": "user", "content": "Check x."},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ]},
    ]  # fmt: skip
    assert store.delete("resp_1") and store.get("resp_1") is None
    assert not store.delete("resp_1")


def test_a_stored_responses_reasoning_is_its_turns_reasoning_content(store: ResponseStore) -> None:
    """A harmony model renders it back while the turn's calls are being answered."""
    response = Response(id="resp_2", created_at=1, model="m", output=[
        ReasoningItem(id="rs_1", content=[ReasoningText(text="Need x.")]),
        FunctionCallItem(id="fc_1", call_id="call_1", name="f", arguments="{}"),
    ])  # fmt: skip
    store.put(msgspec.json.encode(response), [{"role": "user", "content": "Check x."}])
    stored = store.get("resp_2")
    assert stored is not None
    assert stored[1][-1] == {
        "role": "assistant", "content": None, "reasoning_content": "Need x.",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}],
    }  # fmt: skip
