"""POST /v1/responses on a disaggregated cluster through the `openai` SDK: the Response object
and its event stream (each checked against the official OpenAPI description), the same greedy
text as chat completions, previous_response_id, stored responses, function tools and
structured output."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import redis

from tests.integration import openai_spec
from tests.integration.harness import MODEL, Cluster
from tests.redis_server import redis_server

MAX_NEW = 16
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster("disaggregated")


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=60, max_retries=0)


def chat_text(oai: openai.OpenAI, messages: list[dict]) -> str:
    result = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0
    )
    return result.choices[0].message.content or ""


def respond(oai: openai.OpenAI, **options):
    options = {"max_output_tokens": MAX_NEW, "temperature": 0, **options}
    return oai.responses.create(model=MODEL, **options)


def test_a_response_says_what_chat_says_and_matches_the_official_schema(oai) -> None:
    question = "Where do rivers go?"
    response = respond(oai, input=question, instructions="You answer briefly.")
    openai_spec.check("Response", response.model_dump(mode="json", exclude_unset=True))
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    expected = chat_text(oai, [{"role": "system", "content": "You answer briefly."},
                               {"role": "user", "content": question}])  # fmt: skip
    assert response.output_text == expected
    assert response.usage is not None and response.usage.output_tokens >= 1
    assert response.instructions == "You answer briefly." and response.temperature == 0


def test_the_event_stream_is_complete_numbered_and_official(cluster: Cluster, oai) -> None:
    body = {"model": MODEL, "input": "Tell me about caches.", "max_output_tokens": MAX_NEW,
            "temperature": 0, "stream": True}  # fmt: skip
    events = []
    with httpx.stream("POST", f"{cluster.base_url}/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    for event in events:
        openai_spec.check(openai_spec.RESPONSE_EVENTS[event["type"]], event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", kinds[-1]]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert deltas == final["output"][0]["content"][0]["text"]
    with oai.responses.stream(model=MODEL, input=body["input"], max_output_tokens=MAX_NEW,
                              temperature=0) as stream:  # fmt: skip
        sdk_events = list(stream)  # parsed by the SDK's own stream helper
    assert "".join(e.delta for e in sdk_events if e.type == "response.output_text.delta") == deltas
    assert sdk_events[-1].type == kinds[-1] and sdk_events[-1].response.output_text == deltas


def test_previous_response_id_continues_the_conversation(oai) -> None:
    first = respond(oai, input="Name a river.")
    second = respond(oai, input="How long is it?", previous_response_id=first.id)
    expected = chat_text(oai, [{"role": "user", "content": "Name a river."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "How long is it?"}])  # fmt: skip
    assert second.output_text == expected
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens


def test_stored_responses_can_be_read_and_deleted(oai) -> None:
    response = respond(oai, input="Remember me.")
    assert oai.responses.retrieve(response.id).output_text == response.output_text
    oai.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)
    unstored = respond(oai, input="Forget me.", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        respond(oai, input="Go on.", previous_response_id="resp_nope")


def test_a_function_call_and_its_output_sent_back(oai) -> None:
    called = respond(oai, input="What's the weather in Oslo?", tools=[WEATHER],
                     tool_choice={"type": "function", "name": "get_weather"},
                     max_output_tokens=64)  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    answer = respond(oai, previous_response_id=called.id, tools=[WEATHER],
                     input=[{"type": "function_call_output", "call_id": call.call_id,
                             "output": "4 C, rain"}])  # fmt: skip
    assert answer.status in ("completed", "incomplete") and answer.output


def test_json_schema_text_format(oai) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    response = oai.responses.create(
        model=MODEL, input="A city, as JSON.", max_output_tokens=40, temperature=1.0,
        extra_body={"seed": 3},
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )  # fmt: skip
    assert response.status == "completed"
    assert set(json.loads(response.output_text)) == {"city"}


def test_frontends_sharing_a_redis_store_continue_each_others_responses(start_cluster) -> None:
    """responses_store: redis:// for frontends on several hosts: two frontend processes (the
    port's connections split between them) read what the other stored."""
    with redis_server() as url:
        shared = start_cluster("aggregated", frontend=f'processes: 2, responses_store: "{url}"')
        client = openai.OpenAI(base_url=shared.base_url, api_key="x", timeout=60, max_retries=0)
        ids = [respond(client, input=f"Question {i}.").id for i in range(4)]
        for response_id in ids:  # whichever frontend answers, every one is there
            follow_up = respond(client, input="Go on.", previous_response_id=response_id)
            assert follow_up.previous_response_id == response_id
            assert client.responses.retrieve(response_id).id == response_id
        stored = redis.Redis.from_url(url).keys("pdcluster:response:*")
        assert len(stored) == 2 * len(ids)
