"""A GGUF served as stored through the whole cluster, disaggregated (the KV of a quantized
model over NIXL) and aggregated: builtin:smollm2-135m-q4's greedy completions are the engine's in
process, concurrent requests in one batch, its chat streams what it returns whole, and no block
is left behind. Each cluster loads the 94 MB file in a few seconds: `long`.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.integration.harness import Cluster, launch, stop

pytestmark = pytest.mark.long

MODEL = "builtin:smollm2-135m-q4"
PROMPTS = ["The capital of France is", "Water boils at", "The three primary colours are",
           "Once upon a time"]  # fmt: skip
MAX_NEW = 16


@pytest.fixture(scope="module")
def in_process() -> list[list[int]]:
    from common.sampling_params import SamplingParams
    from engine.llm import LLM

    results = LLM(MODEL).generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(params=["disaggregated", "aggregated"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    from engine.builtin_build import ensure_builtin

    ensure_builtin(MODEL)  # built here, not inside `up`'s start-up timeout
    served = launch(tmp_path, request.param, MODEL)
    pids = [w.pid for w in served.info().workers]
    yield served
    stop(served, pids)


def test_the_q4_gguf_serves_in_both_modes(cluster: Cluster, in_process: list[list[int]]) -> None:
    client = openai.OpenAI(base_url=cluster.base_url, api_key="-", timeout=120, max_retries=0)

    def complete(prompt: str) -> list[int]:
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        return list(result.choices[0].token_ids)  # type: ignore[attr-defined]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        ids = list(pool.map(complete, PROMPTS))
    assert ids == in_process
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content and streamed.strip()
    info = cluster.wait_idle()
    assert all(w.blocks_used == 0 and w.blocks_leased == 0 for w in info.workers), info
