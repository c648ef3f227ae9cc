"""The HTTP surface against a real disaggregated cluster, through the official `openai` and
`anthropic` SDKs: every generation route, streaming and not, and the request semantics. The 4xx
answers and the routes that need no cluster (models, tokenize) are tests/unit/frontend's."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from frontend.openapi import ROUTES
from tests.integration import openai_spec
from tests.integration.harness import MODEL, Cluster
from tools.tiny_model.build import TEST_PROMPTS

MAX_NEW = 16
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where do rivers go?"},
]


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster("disaggregated")


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def hf_chat_text(tiny_model_path: Path) -> str:
    """Hugging Face's greedy answer to CHAT, rendered with transformers' apply_chat_template."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def chat(oai: openai.OpenAI, **options):
    options = {"model": MODEL, "messages": CHAT, "max_tokens": MAX_NEW, "temperature": 0, **options}
    return oai.chat.completions.create(**options)


# --- chat -----------------------------------------------------------------------------------------


def test_chat_matches_hf_apply_chat_template_and_generate(oai, hf_chat_text: str) -> None:
    result = chat(oai)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == hf_chat_text
    assert result.usage.completion_tokens <= MAX_NEW


def test_chat_stream_frames(oai, hf_chat_text: str) -> None:
    chunks = list(chat(oai, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hf_chat_text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_chat_logprobs_and_max_completion_tokens(oai) -> None:
    result = chat(oai, logprobs=True, top_logprobs=3, max_tokens=None, max_completion_tokens=5)
    content = result.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_chat_n_choices_and_seed_reproducibility(oai) -> None:
    first = chat(oai, n=2, temperature=1.0, seed=11)
    again = chat(oai, n=2, temperature=1.0, seed=11)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


# --- completions ----------------------------------------------------------------------------------


def test_prompt_forms_give_the_same_text(oai, tiny_model_path: Path) -> None:
    prompt = TEST_PROMPTS[0]
    ids = AutoTokenizer.from_pretrained(tiny_model_path)(prompt).input_ids
    b64 = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()
    options = {"model": MODEL, "max_tokens": MAX_NEW, "temperature": 0}
    text = oai.completions.create(prompt=prompt, **options).choices[0].text
    assert oai.completions.create(prompt=ids, **options).choices[0].text == text
    by_b64 = oai.completions.create(
        prompt=None, extra_body={"prompt_token_ids_b64": b64}, **options
    )
    assert by_b64.choices[0].text == text


def test_a_list_of_prompts_answers_each_in_order(oai) -> None:
    options = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    results = [oai.completions.create(prompt=p, **options) for p in TEST_PROMPTS[:3]]
    singles = [r.choices[0].text for r in results]
    merged = oai.completions.create(prompt=TEST_PROMPTS[:3], n=2, **options)
    assert merged.id.startswith("cmpl-") and not merged.id.endswith("-0")  # one id, the client's
    assert [c.index for c in merged.choices] == list(range(6))
    assert [c.text for c in merged.choices] == [t for t in singles for _ in range(2)]
    assert merged.usage.completion_tokens == 2 * sum(r.usage.completion_tokens for r in results)
    assert merged.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in results)
    stream = oai.completions.create(
        prompt=TEST_PROMPTS[:3], stream=True, stream_options={"include_usage": True}, **options
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == singles
    assert chunks[-1].usage.prompt_tokens == merged.usage.prompt_tokens


def test_echo_logprobs_and_best_of(oai) -> None:
    prompt = TEST_PROMPTS[1]
    result = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2, best_of=1
    )
    choice = result.choices[0]
    assert choice.text.startswith(prompt)
    usage = result.usage
    # the echoed prompt's tokens come first (the first has no log-prob), then the completion's
    assert len(choice.logprobs.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs[1:])


# --- the other routes -----------------------------------------------------------------------------


def test_health_generate_and_openapi(cluster) -> None:
    assert httpx.get(f"{cluster.url}/health_generate", timeout=60).status_code == 200
    document = httpx.get(f"{cluster.url}/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/tokenize"):
        assert "post" in document["paths"][path]
    schemas = document["components"]["schemas"]
    assert "prompt_token_ids_b64" in schemas["CompletionRequest"]["properties"]


# --- Anthropic Messages API -----------------------------------------------------------------------


def test_anthropic_messages_stream_and_count_tokens(cluster, hf_chat_text: str) -> None:
    client = anthropic.Anthropic(base_url=cluster.url, api_key="unused", timeout=60, max_retries=0)
    system, user = CHAT[0]["content"], CHAT[1:]
    greedy = {"temperature": 0}  # an extension: the current Messages API has no temperature
    message = client.messages.create(
        model=MODEL, max_tokens=MAX_NEW, system=system, messages=user, extra_body=greedy
    )
    assert message.content[0].text == hf_chat_text
    assert message.stop_reason in ("max_tokens", "end_turn")
    with client.messages.stream(
        model=MODEL, max_tokens=MAX_NEW, system=system, messages=user, extra_body=greedy
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == hf_chat_text == final.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=user)
    usage = message.usage  # Anthropic counts prefix-cache reads apart from input_tokens
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


# --- lifecycle ------------------------------------------------------------------------------------


def test_client_gone_before_the_answer_frees_everything(cluster) -> None:
    body = {"model": MODEL, "prompt": TEST_PROMPTS[6], "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.base_url}/completions", json=body, timeout=1.5)
    info = cluster.wait_idle()
    assert info.num_requests == 0
    for worker in info.workers:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker


def test_api_key_body_limit_and_two_frontend_processes(start_cluster) -> None:
    guarded = start_cluster(
        "aggregated", frontend="processes: 2, max_body_bytes: 2048", api_key="sekrit"
    )
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200
    frontends = [w.worker_id for w in guarded.info().workers if w.role == "frontend"]
    assert frontends == ["fe-0", "fe-1"]  # two processes share the port
    for path, (method, *_) in ROUTES.items():  # the key guards every route but /health
        status = httpx.request(method.upper(), f"{guarded.url}{path}", timeout=10).status_code
        assert status == (200 if path == "/health" else 401), path
    client = openai.OpenAI(base_url=guarded.base_url, api_key="sekrit", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt="x" * 4000, max_tokens=2)
    assert caught.value.status_code == 413
    claude = anthropic.Anthropic(base_url=guarded.url, api_key="sekrit", max_retries=0)  # x-api-key
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert claude.messages.create(**ask).content is not None
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=guarded.url, api_key="wrong", max_retries=0).messages.create(
            **ask
        )
    assert refused.value.body["type"] == "error"  # Anthropic's shape on its route
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_first_token_that_ends_the_request_still_streams(oai) -> None:
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=TEST_PROMPTS[7], max_tokens=1, temperature=0, stream=True
        )
    )
    assert len(chunks) == 1
    assert chunks[0].choices[0].text and chunks[0].choices[0].finish_reason == "length"


# --- the popular clients' defaults ----------------------------------------------------------------


def test_standard_fields_are_accepted_and_a_returned_message_goes_back_unchanged(oai) -> None:
    """The official API's fields that cannot change the output here are accepted; the assistant
    message exactly as the SDK returns it (refusal, annotations, audio, function_call: null) is a
    valid turn of the next request."""
    first = chat(
        oai, metadata={"team": "a"}, store=False, service_tier="auto", verbosity="low",
        prompt_cache_key="k", safety_identifier="u-1", reasoning_effort="low",
        prediction={"type": "content", "content": "x"}, modalities=["text"], user="me",
    )  # fmt: skip
    message = first.choices[0].message
    assert message.refusal is None
    turn = message.model_dump()  # every field the SDK has, nulls included
    assert {"refusal", "annotations", "audio", "function_call"} <= turn.keys()
    second = chat(oai, messages=[*CHAT, turn, {"role": "user", "content": "And then?"}])
    assert second.choices[0].message.content is not None


def test_a_null_sampling_field_means_the_default(cluster: Cluster) -> None:
    response = httpx.post(f"{cluster.base_url}/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                "temperature": None})  # fmt: skip
    assert response.status_code == 200  # null means the default, as a missing value does
    assert response.json()["choices"][0]["message"]["refusal"] is None


def test_best_of_returns_the_most_likely_of_its_samples(oai) -> None:
    """best_of was validated and then ignored; now best_of choices are sampled and the n with
    the highest cumulative log-prob are returned, usage counting every sample."""
    options = {"model": MODEL, "prompt": TEST_PROMPTS[0], "max_tokens": 8, "temperature": 1.0,
               "seed": 11, "extra_body": {"ignore_eos": True}}  # fmt: skip
    samples = oai.completions.create(n=4, logprobs=0, **options)  # the same seeds per choice
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in samples.choices}
    best = oai.completions.create(n=1, best_of=4, **options)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == max(scores, key=scores.__getitem__)
    assert best.choices[0].logprobs is None  # not asked for: ranked by them, not shown
    assert best.usage is not None and best.usage.completion_tokens == 4 * 8


# --- embeddings -----------------------------------------------------------------------------------


def test_embeddings_forms_formats_and_usage(cluster: Cluster, oai, tiny_model_path: Path) -> None:
    """Floats and base64 (float32 little-endian) carry the same unit vector; token ids embed as
    their text does; a list's usage is the sum of its inputs'."""
    url = f"{cluster.base_url}/embeddings"
    text = TEST_PROMPTS[1]
    floats = httpx.post(url, json={"model": MODEL, "input": text}, timeout=30).json()
    openai_spec.check("CreateEmbeddingResponse", floats)
    as_base64 = {"model": MODEL, "input": text, "encoding_format": "base64"}
    coded = httpx.post(url, json=as_base64, timeout=30).json()
    # (the description types `embedding` as numbers only; base64 is the SDK's default all the same)
    raw = base64.b64decode(coded["data"][0]["embedding"])
    vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert vector == floats["data"][0]["embedding"]
    assert abs(sum(v * v for v in vector) - 1.0) < 1e-4
    assert floats["object"] == "list" and floats["model"] == MODEL
    ids = AutoTokenizer.from_pretrained(tiny_model_path)(text).input_ids
    assert floats["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    by_ids = oai.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert by_ids.data[0].embedding == vector
    both = oai.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert [d.index for d in both.data] == [0, 1] and both.data[0].embedding == vector
    assert both.usage.prompt_tokens == len(ids) + 3
    sized = oai.embeddings.create(model=MODEL, input=text, dimensions=len(vector))
    assert len(sized.data[0].embedding) == len(vector)


# --- the official description ---------------------------------------------------------------------


def sse_payloads(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in response.text.splitlines()
        if line.startswith("data: {")
    ]


def test_bodies_and_chunks_validate_against_the_official_description(cluster: Cluster) -> None:
    base = cluster.base_url
    chat_body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "logprobs": True,
                 "top_logprobs": 2, "n": 2}  # fmt: skip
    response = httpx.post(f"{base}/chat/completions", json=chat_body, timeout=30)
    openai_spec.check("CreateChatCompletionResponse", response.json())
    streamed = {**chat_body, "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(f"{base}/chat/completions", json=streamed, timeout=30)
    chunks = sse_payloads(response)
    assert len(chunks) > 2
    for chunk in chunks:
        openai_spec.check("CreateChatCompletionStreamResponse", chunk)
    # (no echo: the description types every token_logprobs entry as a number, where an echoed
    # prompt's first token has null, as OpenAI's own legacy answers had and lm-eval expects)
    completion_body = {"model": MODEL, "prompt": [TEST_PROMPTS[0], TEST_PROMPTS[1]],
                       "max_tokens": 4, "logprobs": 2}  # fmt: skip
    response = httpx.post(f"{base}/completions", json=completion_body, timeout=30)
    openai_spec.check("CreateCompletionResponse", response.json())
    # (streamed completions have no schema there: its CreateCompletionResponse requires a
    # finish_reason, which chunks before the last have as null in OpenAI's streams too)
    openai_spec.check("ListModelsResponse", httpx.get(f"{base}/models", timeout=30).json())
    openai_spec.check("Model", httpx.get(f"{base}/models/{MODEL}", timeout=30).json())
