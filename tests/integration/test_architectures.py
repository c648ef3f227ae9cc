"""Every architecture through the whole cluster, disaggregated (KV over NIXL) and aggregated:
greedy completions token-identical to transformers `generate` on each tiny checkpoint, concurrent
requests sharing the continuous batch, one prompt long enough to cross the sliding windows and
Phi's pretraining length, and a chat answer that streams the same text it returns whole.

Slow (14 clusters one after another, some checkpoints trained at build time): `long`.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.integration.harness import Cluster, hf_greedy_texts, launch, stop
from tools.tiny_model.build import TEST_PROMPTS

pytestmark = pytest.mark.long

ARCHES = ["mistral", "gemma2", "gemma3", "phi3", "qwen3-moe", "mixtral", "gpt-oss"]
MAX_NEW = 24
PROMPTS = [*TEST_PROMPTS[:4], " ".join(TEST_PROMPTS)]


@pytest.fixture(params=["disaggregated", "aggregated"])
def served(
    request: pytest.FixtureRequest, tmp_path: Path, arch: str
) -> Iterator[tuple[Cluster, str]]:
    """(a cluster serving builtin:tiny-<arch> in the mode, the model name); stopped after."""
    from engine.builtin_build import ensure_builtin

    model = f"builtin:tiny-{arch}"
    ensure_builtin(model)  # built here, not inside `up`'s start-up timeout
    cluster = launch(tmp_path, request.param, model)
    pids = [w.pid for w in cluster.info().workers]
    yield cluster, model
    stop(cluster, pids)


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_completions_match_transformers_in_both_modes(
    served: tuple[Cluster, str], arch: str
) -> None:
    from engine.builtin_build import ensure_builtin

    cluster, model = served
    expected = hf_greedy_texts(ensure_builtin(model), PROMPTS, MAX_NEW)
    client = openai.OpenAI(base_url=cluster.base_url, api_key="-", timeout=120, max_retries=0)

    def complete(prompt: str) -> str:
        result = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0
        )
        return result.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    for prompt, text in zip(PROMPTS, texts, strict=True):
        assert text == expected[prompt], (arch, prompt[:40])
    if arch != "gpt-oss":  # gpt-oss's chat is harmony's: tests/integration/test_harmony.py
        messages = [{"role": "user", "content": "Tell me about rivers."}]
        whole = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_NEW, temperature=0
        )
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_NEW, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == whole.choices[0].message.content
    info = cluster.wait_idle()
    assert all(w.blocks_used == 0 and w.blocks_leased == 0 for w in info.workers), info
