"""The Responses renderer on parsed output: items in output order (reasoning, message, function
calls), the stream's events numbered and paired (added / done), the same items streamed or not,
every event and body valid under the official OpenAPI description."""

from __future__ import annotations

import json

from common.responses_schema import ResponseSettings
from postproc_worker.parsers import ParsedText
from postproc_worker.parsers.tools import ToolCallArguments, ToolCallStart
from postproc_worker.responses_format import ResponsesRenderer, usage
from tests.integration import openai_spec

PIECES = [
    ParsedText(reasoning="The user wants "),
    ParsedText(reasoning="the weather.", events=["Let me look", " that up."]),
    ParsedText(events=[ToolCallStart(0, "call_abc", "get_weather"),
                       ToolCallArguments(0, '{"city": ')]),
    ParsedText(events=[ToolCallArguments(0, '"Oslo"}')]),
]  # fmt: skip
WHOLE = ParsedText(
    reasoning="The user wants the weather.",
    events=["Let me look that up.", ToolCallStart(0, "call_abc", "get_weather"),
            ToolCallArguments(0, '{"city": "Oslo"}')],
)  # fmt: skip


def renderer() -> ResponsesRenderer:
    return ResponsesRenderer("resp_1", "m", 1700000000, ResponseSettings(max_output_tokens=64))


def events_of(frames: bytes) -> list[dict]:
    return [
        json.loads(line[6:]) for line in frames.decode().splitlines() if line.startswith("data: ")
    ]


def test_streamed_items_open_fill_and_close_in_order() -> None:
    stream = renderer()
    frames = b"".join(stream.stream_frames(piece, usage(10, 0, 5)) for piece in PIECES)
    frames += stream.end_frames("stop", None, True, usage(10, 2, 9))
    events = events_of(frames)
    for event in events:
        openai_spec.check(openai_spec.RESPONSE_EVENTS[event["type"]], event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [d["type"] for d in done] == ["reasoning", "message", "function_call"]
    assert done[0]["content"][0]["text"] == "The user wants the weather."
    assert done[1]["content"][0]["text"] == "Let me look that up."
    assert done[2]["arguments"] == '{"city": "Oslo"}' and done[2]["call_id"] == "call_abc"
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["output"] == done
    assert final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 2


def test_the_whole_body_holds_the_same_items_and_says_when_it_is_cut() -> None:
    body = json.loads(renderer().body(WHOLE, "length", None, True, usage(10, 0, 64)))
    openai_spec.check("Response", body)
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["max_output_tokens"] == 64 and body["usage"]["total_tokens"] == 74
