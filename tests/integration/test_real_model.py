"""SmolLM2-135M-Instruct (builtin:smollm2-135m), a real trained model, served by the whole cluster
and checked through the `openai` SDK: token-identical to transformers `generate` in both modes,
real answers, JSON that closes, and tool calls whose arguments match their schema.

Slow (a 30-layer model decoding on two shared cores): `long`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.harness import Cluster

pytestmark = pytest.mark.long

MODEL = "builtin:smollm2-135m"
MAX_NEW = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Explain what a CPU does in one sentence.",
    "Give me a synonym for happy.",
    "What is 12 plus 7?",
    "Name a famous painting by Leonardo da Vinci.",
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def hf_answers(smollm2_path: Path) -> list[tuple[str, int]]:
    """transformers' greedy answer to each question (its own chat template rendering): the text
    as the server decodes it, and the number of tokens."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    answers = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            user(question), add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
        new = out[0, ids.shape[1] :].tolist()
        answers.append((tokenizer.decode(new, skip_special_tokens=True), len(new)))
    return answers


@pytest.fixture(scope="module", params=["disaggregated", "aggregated"])
def cluster(request: pytest.FixtureRequest, start_cluster, smollm2_path: Path) -> Cluster:
    return start_cluster(request.param, model=MODEL)


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=120, max_retries=0)


def ask(cluster: Cluster, messages: list[dict[str, str]], **options):
    options = {"max_tokens": MAX_NEW, "temperature": 0, **options}
    return client(cluster).chat.completions.create(model=MODEL, messages=messages, **options)


def test_greedy_chat_is_token_identical_to_transformers(
    cluster: Cluster, hf_answers: list[tuple[str, int]]
) -> None:
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # one continuous batch
        results = list(pool.map(lambda q: ask(cluster, user(q)), QUESTIONS))
    for question, result, (text, num_tokens) in zip(QUESTIONS, results, hf_answers, strict=True):
        assert result.choices[0].message.content == text, question
        assert result.usage is not None and result.usage.completion_tokens == num_tokens


def test_beam_search_chat_is_transformers_num_beams(cluster: Cluster, smollm2_path: Path) -> None:
    """4 beams, the 2 best returned, as transformers ranks them, on a real model."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    messages = user(QUESTIONS[0])
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids, do_sample=False, num_beams=4, num_return_sequences=2, max_new_tokens=MAX_NEW
        )
    expected = [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]
    result = ask(cluster, messages, n=2, extra_body={"use_beam_search": True, "best_of": 4})
    assert [c.message.content for c in result.choices] == expected


def test_it_knows_the_capital_of_france(cluster: Cluster) -> None:
    answer = ask(cluster, user("What is the capital of France?")).choices[0].message.content
    assert answer is not None and "Paris" in answer


def test_json_schema_answers_are_valid_and_complete_for_ten_seeds(cluster: Cluster) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }

    def sample(seed: int):
        return ask(
            cluster,
            user("Invent a person. Answer with their name and age as JSON."),
            response_format=response_format,
            temperature=1.0,
            seed=seed,
            max_tokens=64,
        )

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(sample, range(10)))
    for seed, result in enumerate(results):
        choice = result.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        person = json.loads(choice.message.content or "")
        jsonschema.validate(person, PERSON_SCHEMA)


def test_a_named_tool_call_has_schema_valid_arguments(cluster: Cluster) -> None:
    result = ask(
        cluster,
        user("What's the weather like in Paris today?"),
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
    )
    choice = result.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls") and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])


def test_one_required_tool_call_and_its_result_sent_back(cluster: Cluster) -> None:
    messages: list = user("What's the weather like in Oslo? Use celsius.")
    first = ask(
        cluster,
        messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].function.name == "get_weather"
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "4 degrees, rain"} for c in calls),
    ]
    second = ask(cluster, messages, tools=[WEATHER_TOOL])
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens


def test_thirty_two_concurrent_requests_all_succeed(cluster: Cluster) -> None:
    """The integrity issue's measurement: 32 concurrent requests of 128-256 prompt tokens on
    this model made prefill steps of seconds, the workers were declared dead mid-step, and 47
    of 48 failed. Heartbeats now come from their own thread."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex ".split()

    def prompt(i: int) -> str:
        return " ".join(words[(i + j) % len(words)] for j in range(120 + 4 * i))

    client_ = client(cluster)
    with ThreadPoolExecutor(32) as pool:
        results = list(
            pool.map(
                lambda i: client_.completions.create(
                    model=MODEL, prompt=prompt(i), max_tokens=8, temperature=0
                ),
                range(32),
            )
        )
    for result in results:
        assert result.usage is not None and result.usage.completion_tokens >= 1
        assert 128 <= result.usage.prompt_tokens <= 400
    assert "missed its heartbeats" not in cluster.log_tail(num_chars=None)
