"""The seed's request extensions and rules, its ops routes and render / generate routes, and the
client-library findings of issue 34, in-process over the fake cluster client: each extension
honoured (what reaches the cluster says so) or refused with a 400 naming it, never as an
unknown field; grammars checked by llguidance with the model's tokenizer."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llguidance
import openai
import pytest
from starlette.testclient import TestClient

from common.config import ClusterConfig, FrontendConfig, LoRAConfig
from common.guided import check
from common.protocol import ClusterInfo, GenerateRequest, WorkerInfo, decode_token_ids
from frontend.app import build_app
from frontend.energy import rapl_readings, read_energy
from frontend.model_info import ModelInfo
from frontend.structured import MAX_TOOL_ENUM_VALUES
from tests.unit.frontend.conftest import MODEL, FakeClusterClient
from tests.unit.frontend.test_harmony_routes import answer_with

ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
OTHER_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>'


@pytest.fixture
def answered(fake: FakeClusterClient, model: ModelInfo) -> FakeClusterClient:
    answer_with(fake, model, "Sunny.", model.eos_token_ids[0])
    return fake


def post_chat(http: TestClient, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **fields}
    return http.post("/v1/chat/completions", json=body)


def refused(response: Any, param: str, says: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert "unknown field" not in error["message"]


# --- the seed's request extensions ----------------------------------------------------------------


def test_conversation_and_scheduling_params_reach_the_cluster(
    http: TestClient, answered: FakeClusterClient
) -> None:
    body = {"conversation_params": {"conversation_id": "conv-7"},
            "scheduling_params": {"priority_tier": 3, "attention_dp_rank": 1,
                                  "attention_dp_relax": True}}  # fmt: skip
    assert post_chat(http, **body).status_code == 200
    sent = answered.submitted[-1]
    assert (sent.conversation_id, sent.priority) == ("conv-7", 3)
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}
    assert http.post("/v1/completions", json=completion).status_code == 200
    assert (answered.submitted[-1].conversation_id, answered.submitted[-1].priority) == (
        "conv-7",
        3,
    )


@pytest.mark.usefixtures("nothing_reaches_the_cluster")
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"conversation_params": {"conversation_id": ""}}, "conversation_params", "non-empty"),
        ({"scheduling_params": {"attention_dp_rank": 0}}, "scheduling_params", "attention"),
        ({"scheduling_params": {"priority_tier": 2}, "priority": 5}, "scheduling_params",
         "disagree"),
        ({"disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 7}},
         "disaggregated_params", "orchestrator"),
        ({"lora_request": {"lora_name": "sql", "lora_int_id": 1, "lora_path": "/x"}},
         "lora_request", "LoRA is off"),
    ],
)  # fmt: skip
def test_extensions_it_cannot_honour_are_400s_naming_them(
    http: TestClient, route: str, fields: dict, param: str, says: str
) -> None:
    base = {"messages": ASK} if route.endswith("chat/completions") else {"prompt": "hi"}
    response = http.post(route, json={"model": MODEL, "max_tokens": 2, **base, **fields})
    refused(response, param, says)


def test_disaggregated_params_for_a_whole_request_and_continuous_usage_are_accepted(
    http: TestClient, answered: FakeClusterClient
) -> None:
    whole = {"request_type": "context_and_generation"}
    assert post_chat(http, disaggregated_params=whole).status_code == 200
    options = {"include_usage": True, "continuous_usage_stats": True}
    with http.stream("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 8, "stream": True,
        "stream_options": options}) as response:  # fmt: skip
        frames = [line for line in response.iter_lines() if line.startswith("data: {")]
    output = answered.submitted[-1].output
    assert output.continuous_usage and output.include_usage
    assert all(json.loads(f[6:])["usage"]["prompt_tokens"] > 0 for f in frames)


def lora_http(fake: FakeClusterClient, model: ModelInfo, tmp_path: Path) -> TestClient:
    adapters = {"sql": "/adapters/sql", "poet": "/adapters/poet"}
    store = str(tmp_path / "s.sqlite3")
    config = ClusterConfig(
        model=MODEL,
        lora=LoRAConfig(adapters=adapters),
        frontend=FrontendConfig(responses_store=store),
    )
    return TestClient(build_app(config, fake, model))


def test_lora_request_runs_the_loaded_adapter_or_says_why_not(
    fake: FakeClusterClient, model: ModelInfo, tmp_path: Path
) -> None:
    answer_with(fake, model, "Sunny.", model.eos_token_ids[0])
    with lora_http(fake, model, tmp_path) as http:
        ok = {"lora_name": "sql", "lora_int_id": 1, "lora_path": "/adapters/sql"}
        assert post_chat(http, lora_request=ok).status_code == 200
        assert fake.submitted[-1].lora_name == "sql"
        completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "lora_request": ok}
        assert http.post("/v1/completions", json=completion).status_code == 200
        assert fake.submitted[-1].lora_name == "sql"
        submitted = len(fake.submitted)
        refused(post_chat(http, lora_request={"lora_name": "haiku"}), "lora_request",
                "not loaded: load it first with POST /v1/load_lora_adapter")  # fmt: skip
        refused(post_chat(http, lora_request={"lora_name": "sql", "lora_path": "/elsewhere"}),
                "lora_request", "/adapters/sql")  # fmt: skip
        refused(post_chat(http, model="poet", lora_request={"lora_name": "sql"}), "lora_request",
                "model names the adapter 'poet' and lora_request 'sql'")  # fmt: skip
        assert len(fake.submitted) == submitted


# --- tools and formats ----------------------------------------------------------------------------


@pytest.mark.usefixtures("nothing_reaches_the_cluster")
def test_a_tool_enum_over_the_seeds_cap_is_a_400_naming_the_tool_and_the_cap(
    http: TestClient,
) -> None:
    values = [f"v{i}" for i in range(MAX_TOOL_ENUM_VALUES + 1)]
    properties = {
        "a": {"enum": values[:600]},
        "b": {"type": "array", "items": {"enum": values[600:]}},
    }
    parameters = {"type": "object", "properties": properties}
    tool = {"type": "function", "function": {"name": "pick", "parameters": parameters}}
    response = post_chat(http, tools=[tool])
    refused(response, "tools[0].function.parameters", "'pick' has 1001 enum values")
    assert "cap of 1000" in response.json()["error"]["message"]


@pytest.mark.usefixtures("nothing_reaches_the_cluster")
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize("fmt", [{"response_format": {"type": "json_object"}},
                                 {"guided_regex": "[a-z]+"}])  # fmt: skip
def test_a_forced_tool_call_beside_a_format_is_a_400(http: TestClient, choice, fmt) -> None:
    response = post_chat(http, tools=[WEATHER], tool_choice=choice, **fmt)
    refused(response, next(iter(fmt)), "forced tool_choice")


def grammar(oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo,
            **fields: Any) -> Callable[[str], bool]:  # fmt: skip
    """The grammar the request sends to the cluster, as a test of whether it lets the model
    write `text` (then stop)."""
    answer_with(fake, model, "x", model.eos_token_ids[0])
    oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **fields)
    guided = fake.submitted[-1].sampling.guided
    assert guided is not None
    check(guided, model.ll_tokenizer())

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(model.ll_tokenizer(), guided.grammar, log_level=0)
        return all(matcher.consume_token(i) for i in model.tokenizer.encode(text)) and (
            matcher.is_accepting()
        )

    return accepts


def test_required_makes_one_call_unless_parallel_tool_calls_is_true(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    one = grammar(oai, fake, model, tools=[WEATHER], tool_choice="required")
    assert one(CALL) and not one(CALL + "\n" + OTHER_CALL)
    off = grammar(oai, fake, model, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False)  # fmt: skip
    assert off(CALL) and not off(CALL + "\n" + OTHER_CALL)
    several = grammar(oai, fake, model, tools=[WEATHER], tool_choice="required",
                      parallel_tool_calls=True)  # fmt: skip
    assert several(CALL) and several(CALL + "\n" + OTHER_CALL)


def test_anthropic_any_makes_one_call(http: TestClient, fake: FakeClusterClient,
                                      model: ModelInfo) -> None:  # fmt: skip
    answer_with(fake, model, CALL, model.eos_token_ids[0])
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    body = {"model": MODEL, "max_tokens": 40, "messages": ASK, "tools": [tool],
            "tool_choice": {"type": "any"}}  # fmt: skip
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    guided = fake.submitted[-1].sampling.guided
    assert guided is not None
    matcher = llguidance.LLMatcher(model.ll_tokenizer(), guided.grammar, log_level=0)
    ids = model.tokenizer.encode(CALL + "\n" + OTHER_CALL)
    assert not all(matcher.consume_token(i) for i in ids)


def test_a_json_schema_object_takes_each_key_once(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "skills": {"type": "array", "items": {"type": "string"}}}}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    accepts = grammar(oai, fake, model, response_format=fmt)
    assert accepts('{"name":"Ada","skills":[]}') and accepts('{"skills":[]}')
    assert not accepts('{"name":"Ada","skills":[],"skills":[]}')
    assert not accepts('{"name":"Ada","skills":[],"x":1,"x":2}')  # no free key to repeat
    # a schema that asks for other keys keeps them (xgrammar's strict_mode does the same)
    open_schema = {**schema, "additionalProperties": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": open_schema}}
    assert grammar(oai, fake, model, response_format=fmt)('{"name":"Ada","x":1}')
    # tool arguments too: a forced call's arguments take each key once
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    named = {"type": "function", "function": {"name": "f"}}
    call = grammar(oai, fake, model, tools=[tool], tool_choice=named)
    assert call('{"name":"f","arguments":{"name":"a"}}\n</tool_call>')
    assert not call('{"name":"f","arguments":{"name":"a","x":1}}\n</tool_call>')


# --- the seed's ops routes ------------------------------------------------------------------------


def worker_info() -> WorkerInfo:
    return WorkerInfo(worker_id="ctx-0", role="context", state="ready", pid=1, address="")


def test_prometheus_metrics_at_the_seeds_path_and_json_at_metrics_when_asked(
    http: TestClient, fake: FakeClusterClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # as frontend/main.py sets it
    fake.info = ClusterInfo(workers=[worker_info()])
    seed, ours = http.get("/prometheus/metrics"), http.get("/metrics")
    assert seed.status_code == ours.status_code == 200, seed.text
    assert seed.headers["content-type"] == ours.headers["content-type"]
    assert seed.headers["content-type"].startswith("text/plain")
    assert seed.text == ours.text and 'worker="ctx-0"' in seed.text
    scraper = http.get("/metrics", headers={"accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1"})
    assert scraper.headers["content-type"].startswith("text/plain")
    as_json = http.get("/metrics", headers={"accept": "application/json"})
    assert as_json.status_code == 200 and [w["worker_id"] for w in as_json.json()] == ["ctx-0"]


def test_steady_clock_offset_answers_the_ntp_pair_and_acknowledges_an_offset(
    http: TestClient,
) -> None:
    before = time.monotonic()
    answer = http.get("/steady_clock_offset").json()
    after = time.monotonic()
    assert before <= answer["receive_ts"] <= answer["transmit_ts"] <= after  # this host's clock
    posted = http.post("/steady_clock_offset", json={"offset": 0.25}).json()
    assert (
        posted["offset"] == 0.25 and posted["applied"] is False and "duration" in posted["reason"]
    )
    assert http.post("/steady_clock_offset", json={"offset": "soon"}).status_code == 400


def test_energy_metrics_sum_the_hosts_counters_or_say_why_not(
    http: TestClient, tmp_path: Path
) -> None:
    readings, why = read_energy()
    response = http.get("/energy_metrics")
    if readings:
        body = response.json()
        assert response.status_code == 200 and body["total_energy_j"] > 0 and body["counters"]
    else:
        assert response.status_code == 404
        assert "cannot measure its energy" in response.json()["error"]["message"]
        assert why in response.json()["error"]["message"]
    # the RAPL reader on a powercap tree laid out as the kernel's: packages, not their parts
    for zone, name, microjoules in [("intel-rapl:0", "package-0", 5_000_000),
                                    ("intel-rapl:0:0", "core", 4_000_000),
                                    ("intel-rapl:1", "package-1", 2_500_000)]:  # fmt: skip
        (tmp_path / zone).mkdir()
        (tmp_path / zone / "name").write_text(name + "\n")
        (tmp_path / zone / "energy_uj").write_text(f"{microjoules}\n")
    got, _ = rapl_readings(tmp_path)
    assert [(r.zone, r.energy_j) for r in got] == [("package-0", 5.0), ("package-1", 2.5)]
    assert rapl_readings(tmp_path / "absent")[1].endswith("does not exist (no RAPL driver, or "
                                                          "not exposed to this host)")  # fmt: skip


# --- the seed's render / generate routes ----------------------------------------------------------


@pytest.fixture
def render_http(make_http: Callable[..., TestClient]) -> Iterator[TestClient]:
    yield make_http(render_endpoints=True)


def test_render_routes_are_off_by_default(http: TestClient) -> None:
    for path in ("/v1/chat/completions/render", "/v1/completions/render", "/generate"):
        assert http.post(path, json={}).status_code == 404


def test_a_rendered_chat_request_runs_as_the_original_would(
    render_http: TestClient, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, "Sunny.", model.eos_token_ids[0])
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0, "seed": 3,
            "nvext": {"gateway": "field"}}  # fmt: skip
    prepared = render_http.post("/v1/chat/completions/render", json=body).json()
    assert fake.submitted == []  # rendering runs nothing
    assert prepared["kind"] == "chat" and prepared["tokens_trusted"] is True
    assert "nvext" not in prepared["request"] and prepared["fingerprint"]["digest"]
    direct = render_http.post("/v1/chat/completions", json={k: v for k, v in body.items()
                                                            if k != "nvext"})  # fmt: skip
    original: GenerateRequest = fake.submitted[-1]
    assert prepared["token_ids"] == decode_token_ids(original.prompt_token_ids_b64)
    ran = render_http.post("/generate", json=prepared)
    assert ran.status_code == direct.status_code == 200
    replayed: GenerateRequest = fake.submitted[-1]
    assert replayed.prompt_token_ids_b64 == original.prompt_token_ids_b64
    assert replayed.sampling == original.sampling
    assert ran.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    # ids rendered under another configuration are a 409, untrusted ones a 400
    other = {**prepared, "fingerprint": {"digest": "0" * 64}}
    assert render_http.post("/generate", json=other).status_code == 409
    named = {**body, "tools": [WEATHER],
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    untrusted = render_http.post("/v1/chat/completions/render", json=named).json()
    assert (
        untrusted["tokens_trusted"] is False
        and "named tool_choice" in untrusted["untrusted_reason"]
    )
    refused(render_http.post("/generate", json=untrusted), "tokens_trusted", "not trusted")


def test_a_rendered_completions_request_is_one_prepared_request_per_prompt(
    render_http: TestClient, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, "Sunny.", model.eos_token_ids[0])
    body = {"model": MODEL, "prompt": ["one fish", "two fish"], "max_tokens": 4}
    prepared = render_http.post("/v1/completions/render", json=body).json()
    assert [p["token_ids"] for p in prepared] == [model.tokenizer.encode(t) for t in body["prompt"]]
    assert all(p["request"]["prompt"] == p["token_ids"] for p in prepared)
    assert render_http.post("/generate", json=prepared[1]).status_code == 200
    assert decode_token_ids(fake.submitted[-1].prompt_token_ids_b64) == prepared[1]["token_ids"]
