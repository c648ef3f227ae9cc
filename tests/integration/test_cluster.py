"""The whole cluster, started with `orchestrator up`, against Hugging Face `generate` through the
official `openai` SDK: disaggregated (KV over NIXL) and aggregated."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from common.sampling_params import SamplingParams
from engine.llm import LLM
from orchestrator.orchestrator import AUTO_PREFILL_QUEUE_SIZE
from tests.integration.harness import MODEL, Cluster, hf_greedy_texts
from tools.tiny_model.build import TEST_PROMPTS

MAX_NEW = 24
SHARED_PREFIX = (
    "You are a careful assistant. Read the question, think about the facts you know, and answer "
    "in one short sentence. Question: "
)


@pytest.fixture(scope="module")
def hf_texts(tiny_model_path: Path) -> dict[str, str]:
    prompts = [*TEST_PROMPTS, SHARED_PREFIX + "why is the sky blue?"]
    return hf_greedy_texts(tiny_model_path, prompts, MAX_NEW)


@pytest.fixture(scope="module", params=["disaggregated", "aggregated"])
def cluster(request: pytest.FixtureRequest, start_cluster) -> Cluster:
    return start_cluster(request.param)


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=60, max_retries=0)


def complete(cluster: Cluster, prompt: str, **options) -> openai.types.Completion:
    options = {"max_tokens": MAX_NEW, "temperature": 0, **options}
    return client(cluster).completions.create(model=MODEL, prompt=prompt, **options)


def test_greedy_completions_match_hf_generate(cluster: Cluster, hf_texts: dict[str, str]) -> None:
    def routed() -> dict[str, int]:
        workers = cluster.info().workers
        return {
            "context": sum(w.requests_routed for w in workers if w.role == "context"),
            "generation": sum(w.requests_routed for w in workers if w.role == "generation"),
            "deflected": sum(w.local_prefills_routed for w in workers if w.role == "generation"),
        }

    before = routed()
    with ThreadPoolExecutor(4) as pool:  # concurrent requests share the continuous batch
        results = list(pool.map(lambda p: complete(cluster, p), TEST_PROMPTS))
    for prompt, result in zip(TEST_PROMPTS, results, strict=True):
        assert result.choices[0].text == hf_texts[prompt], prompt
        assert result.usage is not None and result.usage.completion_tokens >= 1
    # each request was decoded by a generation worker and prefilled once: aggregated, there;
    # disaggregated, by a context worker, or by the generation worker where the default
    # deflection ("auto") dealt it out of the context queue (of a burst of four, at most the
    # two past that queue's two)
    after = routed()
    change = {role: after[role] - before[role] for role in after}
    has_context = any(w.role == "context" for w in cluster.info().workers)
    assert change["generation"] == len(TEST_PROMPTS)
    if has_context:
        assert change["context"] + change["deflected"] == len(TEST_PROMPTS)
        assert change["deflected"] <= len(TEST_PROMPTS) - AUTO_PREFILL_QUEUE_SIZE
    else:
        assert change["context"] == 0


def test_streamed_text_equals_the_whole_text(cluster: Cluster, hf_texts: dict[str, str]) -> None:
    prompt = TEST_PROMPTS[0]
    stream = client(cluster).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == hf_texts[prompt]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_second_run_of_a_shared_prompt_hits_the_prefix_cache(
    cluster: Cluster, hf_texts: dict[str, str]
) -> None:
    prompt = SHARED_PREFIX + "why is the sky blue?"
    before = cluster.wait_idle().workers
    generation = {w.worker_id: w for w in before if w.role == "generation"}
    first, second = complete(cluster, prompt), complete(cluster, prompt)
    assert first.choices[0].text == second.choices[0].text == hf_texts[prompt]
    num_prompt = first.usage.prompt_tokens
    assert num_prompt > 32
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16
    if cluster.workers("context"):
        # The generation worker pulled the whole prompt once; the second time only the last,
        # partial block: its full blocks were in its own prefix cache by then.
        after = {w.worker_id: w for w in cluster.wait_idle().workers if w.role == "generation"}
        pulled = sum(after[i].kv_bytes_pulled - generation[i].kv_bytes_pulled for i in after)
        block_bytes = 4 * 2 * 16 * 2 * 32 * 4  # layers, K/V, block_size, kv heads, head_dim, fp32
        num_blocks = -(-num_prompt // 16)
        assert pulled == (num_blocks + (1 if num_prompt % 16 else 0)) * block_bytes


def test_generation_worker_reads_kv_over_nixl_instead_of_recomputing(cluster: Cluster) -> None:
    def totals() -> tuple[int, float, int]:
        generation = [w for w in cluster.wait_idle().workers if w.role == "generation"]
        return (
            sum(w.kv_bytes_pulled for w in generation),
            sum(w.kv_pull_seconds for w in generation),
            sum(w.prompt_tokens_computed for w in generation),
        )

    before = totals()
    complete(cluster, TEST_PROMPTS[1])  # alone: no deflection
    pulled, pull_seconds, computed = (a - b for a, b in zip(totals(), before, strict=True))
    if cluster.workers("context"):
        assert pulled > 0 and pull_seconds > 0
        assert computed == 0
    else:
        assert computed > 0
        assert pulled == 0


BEAM = {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True}


def test_beam_search_returns_transformers_num_beams_hypotheses(
    cluster: Cluster, tiny_model_path: Path
) -> None:
    """best_of 3 beams, the 2 best returned, as `generate(num_beams=3)` ranks them; streamed
    the same (all at the end). Disaggregated, the beams start from the context worker's offer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for prompt in TEST_PROMPTS[:2]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, do_sample=False, num_beams=3, num_return_sequences=2, max_new_tokens=MAX_NEW,
                length_penalty=0.5, early_stopping=True,
            )  # fmt: skip
        expected = [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]
        result = complete(cluster, prompt, n=2, best_of=3, extra_body=BEAM)
        assert [c.text for c in result.choices] == expected, prompt
        texts = ["", ""]
        for chunk in complete(cluster, prompt, n=2, best_of=3, stream=True, extra_body=BEAM):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == expected
    answers = [
        client(cluster).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], n=2, max_tokens=8,
            extra_body={**BEAM, "best_of": 3},
        )
        for _ in range(2)
    ]  # fmt: skip
    assert [len(a.choices) for a in answers] == [2, 2]
    assert [c.message.content for c in answers[0].choices] == [
        c.message.content for c in answers[1].choices
    ]  # deterministic


def test_every_kv_block_is_free_or_cached_afterwards(cluster: Cluster) -> None:
    info = cluster.wait_idle()
    engines = [w for w in info.workers if w.role in ("context", "generation")]
    assert engines
    for worker in engines:
        assert worker.blocks_used == 0, worker
        assert worker.blocks_leased == 0, worker
        assert worker.active_requests == 0, worker
        assert worker.blocks_total == 512
    assert info.num_requests == 0


def test_stop_string_trims_the_text_and_stops_the_generation(
    cluster: Cluster, hf_texts: dict[str, str]
) -> None:
    prompt = TEST_PROMPTS[2]
    expected = hf_texts[prompt]
    stop = expected[len(expected) // 2 :][:3]
    result = complete(cluster, prompt, stop=[stop])
    assert result.choices[0].text == expected[: expected.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    assert cluster.wait_idle().num_requests == 0


def test_first_token_that_ends_the_request(cluster: Cluster, hf_texts: dict[str, str]) -> None:
    prompt = TEST_PROMPTS[3]
    result = complete(cluster, prompt, max_tokens=1)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 1
    assert hf_texts[prompt].startswith(result.choices[0].text)


def test_n_seeded_choices_with_logprobs_sample_like_the_engine_in_process(
    cluster: Cluster, tiny_model_path: Path
) -> None:
    """A seeded draw depends on (seed, choice, position) only, so whether the first token comes
    from a context worker and the rest from a generation worker or all from one, the text is the
    in-process engine's."""
    result = client(cluster).completions.create(
        model=MODEL,
        prompt=TEST_PROMPTS[4],
        max_tokens=8,
        temperature=0.9,
        seed=3,
        n=3,
        logprobs=2,
    )
    params = SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=8)
    (expected,) = LLM(str(tiny_model_path), num_blocks=64).generate([TEST_PROMPTS[4]], params)
    texts = {c.index: c.text for c in result.choices}
    assert texts == {out.index: out.text for out in expected.outputs}
    assert len(set(texts.values())) == 3
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    for choice in result.choices:
        assert choice.finish_reason in ("length", "stop")
        assert 1 <= len(choice.logprobs.tokens) <= 8
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert result.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in result.choices)


def test_client_that_disconnects_mid_stream_frees_its_blocks(cluster: Cluster) -> None:
    body = {
        "model": MODEL,
        "prompt": TEST_PROMPTS[5] * 4,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{cluster.base_url}/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    info = cluster.wait_idle()
    assert info.num_requests == 0
    for worker in info.workers:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model_path: Path) -> tuple[list[int], list[float]]:
    """A prompt's ids and HF's log-prob of each of its tokens given the ones before."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = tokenizer(SHARED_PREFIX + "what is a lease?").input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_like_hf(
    cluster: Cluster, hf_prompt_logprobs, stream: bool
) -> None:
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0. It got every log-prob 0
    (accuracy 1, perplexity 1) before; now the prompt's own log-probs, HF's to 1e-3."""
    ids, expected = hf_prompt_logprobs
    options = {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    if stream:
        chunks = list(client(cluster).completions.create(model=MODEL, prompt=ids, stream=True,
                                                          **options))  # fmt: skip
        choice = chunks[0].choices[0]
        assert "".join(c.choices[0].text for c in chunks) == choice.text
    else:
        result = client(cluster).completions.create(model=MODEL, prompt=ids, **options)
        choice = result.choices[0]
        assert result.usage is not None and result.usage.completion_tokens == 0
        assert choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-3)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text  # the echo, token by token


@pytest.fixture(scope="module")
def hf_embeddings(tiny_model_path: Path) -> list[torch.Tensor]:
    """Transformers' own final hidden state of each prompt's last token, normalized."""
    model = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    vectors = []
    for prompt in TEST_PROMPTS[:4]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = model(ids).last_hidden_state[0, -1]
        vectors.append(torch.nn.functional.normalize(hidden, dim=-1))
    return vectors


def test_embeddings_are_transformers_last_hidden_states(
    cluster: Cluster, hf_embeddings: list[torch.Tensor]
) -> None:
    """Four inputs in one request (fanned out, merged in order), twice: the second time the
    prompts are in the prefix cache and only their last token is computed again."""
    for _ in range(2):
        result = client(cluster).embeddings.create(model=MODEL, input=TEST_PROMPTS[:4])
        assert [d.index for d in result.data] == [0, 1, 2, 3]
        for item, expected in zip(result.data, hf_embeddings, strict=True):
            vector = torch.tensor(item.embedding)
            assert vector.shape == expected.shape
            assert torch.allclose(vector, expected, atol=1e-4), (vector - expected).abs().max()
    assert result.usage.prompt_tokens == result.usage.total_tokens > 4


STAGES = ("queue_s", "prefill_s", "transfer_s", "first_token_s", "decode_s")


def server_timing(header: str) -> dict[str, float]:
    """`name;dur=ms, ...` as {name: ms}."""
    entries = [part.strip().split(";dur=") for part in header.split(",")]
    return {name: float(ms) for name, ms in entries}


def test_perf_metrics_say_where_the_time_went(cluster: Cluster) -> None:
    """return_perf_metrics: each stage as the workers measured it (durations on each host's own
    clock), in the body, in a stream's last chunk, and as the Server-Timing header."""
    disaggregated = any(w.role == "context" for w in cluster.info().workers)
    body = {"model": MODEL, "temperature": 0, "max_tokens": 8, "ignore_eos": True,
            "prompt": "perf metrics: a prompt no worker has cached yet, about rivers"}  # fmt: skip
    response = httpx.post(
        f"{cluster.base_url}/completions", json={**body, "return_perf_metrics": True}, timeout=60
    )
    metrics = response.json()["perf_metrics"]
    assert set(metrics) == set(STAGES)
    assert metrics["prefill_s"] > 0 and metrics["decode_s"] > 0 and metrics["queue_s"] >= 0
    assert metrics["first_token_s"] >= metrics["prefill_s"]
    assert (metrics["transfer_s"] > 0) == disaggregated  # the KV pull happens only then
    timing = server_timing(response.headers["server-timing"])
    assert set(timing) == {s.removesuffix("_s") for s in STAGES} | {"total"}
    assert timing["prefill"] == pytest.approx(metrics["prefill_s"] * 1e3, abs=0.06)
    assert timing["total"] >= timing["first_token"] + timing["decode"] - 1.0
    # not asked: no field, the header all the same
    plain = httpx.post(f"{cluster.base_url}/completions", json=body, timeout=60)
    assert "perf_metrics" not in plain.json() and "server-timing" in plain.headers
    # streamed: a last chunk with no choices carries them, merged with the usage chunk
    frames = []
    stream = {**body, "stream": True, "return_perf_metrics": True, "prompt": ["river", "sea"],
              "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{cluster.base_url}/completions", json=stream, timeout=60) as r:
        frames = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    last = json.loads(frames[-2][len("data: ") :])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16
    assert set(last["perf_metrics"]) == set(STAGES) and last["perf_metrics"]["decode_s"] > 0
    assert all("perf_metrics" not in json.loads(f[len("data: ") :]) for f in frames[:-2])
    scrape = httpx.get(f"{cluster.base_url.removesuffix('/v1')}/metrics", timeout=10).text
    assert 'pdcluster_request_stage_seconds_count{stage="transfer"}' in scrape
