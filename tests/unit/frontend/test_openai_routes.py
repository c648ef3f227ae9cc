"""POST /v1/completions, /v1/chat/completions and /v1/embeddings in-process: every request the
frontend refuses is a 400 (404 for an unknown model or route) in the one error shape, naming the
parameter, and none of them reaches the cluster."""

from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from common.config import ClusterConfig, FrontendConfig, SpeculativeConfig
from common.protocol import encode_token_ids
from frontend.app import build_app
from frontend.model_info import load_model_info
from tests.integration import openai_spec
from tools.tiny_model.build import TEST_PROMPTS

MODEL = "builtin:tiny"
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where do rivers go?"},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
BEAM = {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True}


# each test's requests are refused before anything is submitted
pytestmark = pytest.mark.usefixtures("nothing_reaches_the_cluster")


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"bogus_field": 1}, "bogus_field"),
        ({"suffix": "x"}, "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"stop": [""]}, "stop"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_invalid_completion_requests_are_400_naming_the_param(
    http: TestClient, options, param
) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **options}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ],
)
def test_invalid_chat_requests_are_400_naming_the_param(http: TestClient, options, param) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **options}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_malformed_json_unknown_model_and_unknown_route(http: TestClient, oai) -> None:
    response = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "error" in response.json()
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="hi")
    missing = http.get("/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_fields_it_cannot_honour_are_400s_that_say_why(http: TestClient) -> None:
    cases = [
        ({"modalities": ["text", "audio"]}, "audio"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "deprecated"),
        ({"web_search_options": {}}, "web search"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
    ]
    for fields, says in cases:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (fields, response.text)
        assert says in response.text, (fields, response.text)


def test_best_of_cannot_be_streamed(oai) -> None:
    options = {"model": MODEL, "prompt": TEST_PROMPTS[0], "max_tokens": 8, "temperature": 1.0,
               "seed": 11, "extra_body": {"ignore_eos": True}}  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(n=1, best_of=2, stream=True, **options)


def test_bad_request_gets_an_openai_error(oai) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert "maximum context length" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="hi")


@pytest.mark.parametrize(
    "options, param",
    [
        ({"extra_body": {"length_penalty": 2.0}}, "length_penalty"),
        ({"extra_body": {"early_stopping": True}}, "early_stopping"),
        ({"best_of": 3, "top_p": 0.5, "extra_body": {"use_beam_search": True}}, "top_p"),
        ({"best_of": 3, "logprobs": 2, "extra_body": {"use_beam_search": True}}, "logprobs"),
        ({"best_of": 99, "extra_body": {"use_beam_search": True}}, "best_of"),
        ({"extra_body": {"use_beam_search": True, "length_penalty": 1e308}}, "length_penalty"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(oai, options, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=24, temperature=0, **options)
    assert refused.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as refused:  # best_of is the beam width in chat
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"best_of": 2}
        )
    assert refused.value.body["param"] == "best_of"


def test_beam_search_is_refused_where_the_cluster_speculates(fake, tmp_path) -> None:
    """Beams rank every candidate each step; proposals verified a run at a time cannot serve
    them: a 400 on both routes, not a silently slower path."""
    config = ClusterConfig(
        model=MODEL,
        speculative=SpeculativeConfig(),
        frontend=FrontendConfig(responses_store=str(tmp_path / "store.sqlite3")),
    )
    with TestClient(build_app(config, fake, load_model_info(config))) as http:
        oai = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        beam = {"use_beam_search": True}
        with pytest.raises(openai.BadRequestError, match="speculative") as refused:
            oai.completions.create(model=MODEL, prompt="hi", best_of=2, extra_body=beam)
        assert refused.value.body["param"] == "use_beam_search"
        with pytest.raises(openai.BadRequestError, match="speculative") as refused:
            oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=beam
            )
        assert refused.value.body["param"] == "use_beam_search"


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (
            {
                "tools": [
                    {"type": "function", "function": {**WEATHER["function"], "strict": True}}
                ],
                "guided_regex": "[0-9]+",
            },
            "guided_regex",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"guided_regex": "[0-9]+", "guided_json": {"type": "object"}}, "guided_regex"),
        ({"guided_regex": "[unclosed"}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
    ],
)
def test_conflicting_or_broken_constraints_are_400(http: TestClient, options, param) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **options}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_token_ids": [1, 2], "prompt_token_ids_b64": encode_token_ids([1, 2])},
         "prompt_token_ids"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [10**9]}, "prompt_token_ids"),
        ({"prompt_token_ids_b64": "AAA"}, "prompt_token_ids_b64"),
        ({"prompt_token_ids": [1, 2, 3], "tool_choice": {"type": "function",
          "function": {"name": "get_time"}}, "tools": [{"type": "function", "function": {
              "name": "get_time", "parameters": {"type": "object", "properties": {}}}}]},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_prompt_ids_and_a_forced_call_on_ids_are_400s(
    http: TestClient, extra: dict, param: str
) -> None:
    greedy = {"model": MODEL, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    body = {**greedy, "messages": [{"role": "user", "content": "Tell me about the river."}]}
    response = http.post("/v1/chat/completions", json={**body, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_embeddings_bad_input_is_a_400_and_leaves_nothing(http: TestClient) -> None:
    cases = [
        ({"input": ""}, "no tokens"),
        ({"input": []}, "must not be empty"),
        ({"input": [[]]}, "no tokens"),
        ({"input": ["a"] * 2049}, "at most 2048"),
        ({"input": [1.5]}, "input"),
        ({"input": [[1, 2], "a"]}, "input"),
        ({"input": [10**9]}, "token ids must be in"),
        ({"input": list(range(5000))}, "embeds at most"),
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "stream": True}, "stream"),
    ]
    for fields, says in cases:
        response = http.post("/v1/embeddings", json={"model": MODEL, **fields})
        assert response.status_code == 400, (fields, response.text)
        assert says in response.text, (fields, response.text)
        openai_spec.check("ErrorResponse", response.json())
    response = http.post("/v1/embeddings", json={"model": "other", "input": "hi"})
    assert response.status_code == 404
    # (nothing_reaches_the_cluster: no request was submitted, none is open)


def test_errors_validate_against_the_official_description(http: TestClient) -> None:
    for response in [
        http.get("/v1/models/nope"),
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}),
        http.post("/v1/chat/completions", content=b"{"),
    ]:
        assert response.status_code in (400, 404)
        openai_spec.check("ErrorResponse", response.json())
