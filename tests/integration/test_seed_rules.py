"""Issue 34's rows but images, from outside, on one disaggregated cluster (two context workers,
round-robin routing, a LoRA adapter, the render routes on) with the official openai SDK and
httpx: the seed's request extensions honoured (the adapter's tokens, a conversation kept on one
context worker, the usage on every chunk) or refused with a 400 naming them; the tool enum cap
and a forced call beside a format refused; the seed's ops routes; a rendered request run by
/generate as the original; one call under tool_choice required, and a streamed call turn that
opens with `content: null`; no JSON-schema object with a repeated key."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.harness import MODEL, Cluster
from tests.lora_adapters import make_adapter

pytestmark = pytest.mark.long

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"]}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def cluster(start_cluster: Callable[..., Cluster], tiny_model_path: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Cluster:  # fmt: skip
    adapter = make_adapter(tiny_model_path, tmp_path_factory.mktemp("adapters") / "sql", seed=10)
    extra = (f"lora: {{adapters: {{sql: {adapter}}}, max_loras: 1, max_lora_rank: 8}}\n"
             "context_workers: {count: 2}\n")  # fmt: skip
    return start_cluster("disaggregated", extra=extra, frontend="render_endpoints: true",
                         orchestrator="router: round_robin, worker_timeout_seconds: 5")  # fmt: skip


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, timeout=120)


def greedy_ids(oai: openai.OpenAI, **extra: Any) -> list[int]:
    result = oai.completions.create(
        model=extra.pop("model", MODEL), prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )  # fmt: skip
    return list(result.choices[0].token_ids)  # type: ignore[attr-defined]


def refused(call: Callable[[], Any], param: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        call()
    body = error.value.body
    assert isinstance(body, dict) and body["param"] == param and says in body["message"], body
    assert "unknown field" not in body["message"]


# --- the seed's request extensions ----------------------------------------------------------------


def test_lora_request_runs_the_adapter_as_model_does(oai: openai.OpenAI, cluster: Cluster) -> None:
    base, by_model = greedy_ids(oai), greedy_ids(oai, model="sql")
    assert by_model != base
    request = {"lora_name": "sql", "lora_int_id": 1}
    assert greedy_ids(oai, lora_request=request) == by_model
    refused(lambda: greedy_ids(oai, lora_request={"lora_name": "poet"}), "lora_request",
            "not loaded")  # fmt: skip


def test_a_conversation_stays_on_one_context_worker(oai: openai.OpenAI, cluster: Cluster) -> None:
    def routed() -> dict[str, int]:
        return {w.worker_id: w.requests_routed for w in cluster.workers("context")}

    before = routed()
    for turn in range(4):
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Turn {turn} of our talk."}],
            max_tokens=2, extra_body={"conversation_params": {"conversation_id": "conv-1"}},
        )  # fmt: skip
    after = routed()
    assert sorted(after[w] - before[w] for w in after) == [0, 4]  # round robin would split 2 / 2
    for turn in range(4):
        alone = [{"role": "user", "content": f"Alone {turn}."}]
        oai.chat.completions.create(model=MODEL, max_tokens=2, messages=alone)  # type: ignore[arg-type]
    spread = routed()
    assert sorted(spread[w] - after[w] for w in spread) == [2, 2]


def test_scheduling_and_disaggregated_params_honoured_or_refused(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create
    ok = chat(model=MODEL, messages=ASK, max_tokens=2,
              extra_body={"scheduling_params": {"priority_tier": 2}, "disaggregated_params": {
                  "request_type": "context_and_generation"}})  # fmt: skip
    assert ok.choices[0].message.content is not None
    refused(lambda: chat(model=MODEL, messages=ASK, max_tokens=2,
                         extra_body={"scheduling_params": {"attention_dp_rank": 1}}),
            "scheduling_params", "attention data-parallel")  # fmt: skip
    handoff = {"request_type": "generation_only", "ctx_request_id": 5, "first_gen_tokens": [7]}
    refused(lambda: chat(model=MODEL, messages=ASK, max_tokens=2,
                         extra_body={"disaggregated_params": handoff}),
            "disaggregated_params", "orchestrator")  # fmt: skip


def test_continuous_usage_stats_put_the_usage_on_every_chunk(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=10, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    used = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert used == sorted(used) and used[-1] == 10 and chunks[-1].choices == []


# --- tools and formats ----------------------------------------------------------------------------


def test_the_tool_enum_cap_and_a_forced_call_beside_a_format_are_400s(oai: openai.OpenAI) -> None:
    values = [str(i) for i in range(1001)]
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"enum": values}}}}}  # fmt: skip
    chat = oai.chat.completions.create
    refused(lambda: chat(model=MODEL, messages=ASK, tools=[pick]),  # type: ignore[list-item]
            "tools[0].function.parameters", "'pick' has 1001 enum values")  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = functools.partial(
            chat, model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
            response_format={"type": "json_object"},
        )  # fmt: skip
        refused(forced, "response_format", "forced tool_choice")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_makes_one_call_and_streams_it_after_a_null_content(
    oai: openai.OpenAI, seed: int
) -> None:
    options: Any = {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 1.0,
                    "seed": seed, "tools": [WEATHER], "tool_choice": "required",
                    "extra_body": NO_THINKING}  # fmt: skip
    message = oai.chat.completions.create(**options).choices[0].message
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    chunks = list(oai.chat.completions.create(**options, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None and first.tool_calls
    calls = {d.index for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []}
    assert calls == {0}
    several = oai.chat.completions.create(**options, parallel_tool_calls=True).choices[0].message
    made = [(c.function.name, json.loads(c.function.arguments)) for c in several.tool_calls or []]
    assert made and all(made[i] not in made[:i] for i in range(len(made)))  # none repeats


def test_a_json_schema_object_never_repeats_a_key(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "skills": {"type": "array", "items": {"enum": ["go", "rust"]}, "maxItems": 2}}}  # fmt: skip
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)

    for seed in range(8):
        result = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, seed=seed,
                                             temperature=1.0, response_format=fmt)  # fmt: skip
        assert result.choices[0].finish_reason == "stop"
        value = json.loads(result.choices[0].message.content or "", object_pairs_hook=no_repeats)
        assert set(value) <= {"name", "skills"}


# --- the seed's ops routes ------------------------------------------------------------------------


def test_the_seeds_ops_routes(http: httpx.Client) -> None:
    seed, ours = http.get("/prometheus/metrics"), http.get("/metrics")
    assert seed.status_code == ours.status_code == 200
    families = {line.split()[2] for line in seed.text.splitlines() if line.startswith("# TYPE")}
    assert "pdcluster_requests_total" in families and 'role="context"' in seed.text
    assert families == {line.split()[2] for line in ours.text.splitlines()
                        if line.startswith("# TYPE")}  # fmt: skip
    as_json = http.get("/metrics", headers={"accept": "application/json"}).json()
    assert {w["role"] for w in as_json} >= {"context", "generation", "postproc"}

    sent = time.monotonic()
    clock = http.get("/steady_clock_offset").json()
    received = time.monotonic()
    offset = ((clock["receive_ts"] - sent) + (clock["transmit_ts"] - received)) / 2
    assert abs(offset) < received - sent + 1e-3  # one host, one monotonic clock: no offset
    posted = http.post("/steady_clock_offset", json={"offset": offset}).json()
    assert posted["applied"] is False

    energy = http.get("/energy_metrics")
    if energy.status_code == 200:  # a host with RAPL or an NVIDIA GPU
        body = energy.json()
        assert body["total_energy_j"] == pytest.approx(sum(c["energy_j"] for c in body["counters"]))
    else:
        assert energy.status_code == 404 and "cannot measure" in energy.json()["error"]["message"]


def test_a_rendered_request_runs_by_generate_as_the_original(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    direct = http.post("/v1/chat/completions", json=body).json()
    prepared = http.post("/v1/chat/completions/render", json=body).json()
    assert prepared["token_ids"] == direct["prompt_token_ids"]
    ran = http.post("/generate", json=prepared).json()
    assert ran["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert ran["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    stale = http.post("/generate", json={**prepared, "fingerprint": {"digest": "stale"}})
    assert stale.status_code == 409
