"""POST /v1/messages and the Message Batches routes in-process: what the frontend refuses gets
Anthropic's error shape and status, and none of it reaches the cluster."""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

MODEL = "builtin:tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "description": "The weather in a city",
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
ANTHROPIC_TOOLS = [WEATHER, TIME]


def params(i: int, max_tokens: int = 6, **extra: object) -> dict:
    messages = [{"role": "user", "content": f"Question {i}: tell me about the river."}]
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "messages": messages,
            **extra}  # fmt: skip


@pytest.mark.usefixtures("nothing_reaches_the_cluster")
@pytest.mark.parametrize(
    ("options", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
            "text only",
        ),  # fmt: skip
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}, "needs a name"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "x"}}, "not in tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"),
        ({"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "tool_result"),
    ],
)  # fmt: skip
def test_anthropic_requests_it_cannot_serve_are_400(http: TestClient, options, says) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": ASK, **options}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    body = response.json()  # Anthropic's own error shape on its route
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert set(error) == {"type", "message"}
    assert error["type"] == "invalid_request_error" and says in error["message"], error


@pytest.mark.usefixtures("nothing_reaches_the_cluster")
def test_bad_batches_get_anthropic_errors(http: TestClient) -> None:
    url = "/v1/messages/batches"
    cases = [
        {"requests": []},
        {"requests": [{"custom_id": "a", "params": params(0)}] * 2},
        {"requests": [{"custom_id": "has space", "params": params(0)}]},
        {"requests": [{"custom_id": "s", "params": params(0, stream=True)}]},
        {"requests": [{"custom_id": "x", "params": {"model": MODEL}}]},
    ]
    for body in cases:
        answer = http.post(url, json=body)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["type"] == "invalid_request_error"
    wrong_model = {"requests": [{"custom_id": "m", "params": {**params(0), "model": "claude"}}]}
    assert http.post(url, json=wrong_model).status_code == 404
    for path in ("msgbatch_nope", "msgbatch_nope/results"):
        missing = http.get(f"{url}/{path}")
        assert missing.status_code == 404 and missing.json()["type"] == "error"


def test_a_running_batch_has_no_results_and_cannot_be_deleted(http: TestClient, fake) -> None:
    """The fake cluster never answers: the batch runs until it is canceled, and its request is
    aborted then."""
    url = "/v1/messages/batches"
    created = http.post(url, json={"requests": [{"custom_id": "slow", "params": params(0, 200)}]})
    assert created.status_code == 200, created.text
    running = created.json()
    early = http.get(f"{url}/{running['id']}/results")
    assert early.status_code == 400 and "not ended" in early.text
    assert http.delete(f"{url}/{running['id']}").status_code == 400
    assert http.post(f"{url}/{running['id']}/cancel").status_code == 200
    deadline = time.monotonic() + 60
    while http.get(f"{url}/{running['id']}").json()["processing_status"] != "ended":
        assert time.monotonic() < deadline, "the canceled batch did not end"
        time.sleep(0.1)
    assert fake.aborted == [r.request_id for r in fake.submitted] and len(fake.aborted) == 1
