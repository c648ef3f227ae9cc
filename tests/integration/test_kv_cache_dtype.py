"""A disaggregated cluster with `kv_cache.dtype: int8`: the generation worker reads the context
worker's int8 blocks (values and scales in one byte range each) over NIXL instead of computing
the prompt, and the greedy completions are those of one engine in process with the same cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.integration.harness import MODEL, Cluster
from tools.tiny_model.build import TEST_PROMPTS

MAX_NEW = 16
PREFIX = "Read the question, think about the facts you know, and answer in one sentence. "
PROMPTS = [PREFIX + p for p in TEST_PROMPTS[:3]]
# the tiny model's block: 4 layers x K/V x 16 tokens x 2 kv heads x (32 int8 values + a scale)
INT8_BLOCK_BYTES = 4 * 2 * 16 * 2 * (32 + 4)


def test_int8_kv_is_handed_off_and_decodes_as_in_process(
    start_cluster: Callable[..., Cluster], tiny_model_path: Path
) -> None:
    llm = LLM(MODEL, block_size=16, num_blocks=512, kv_cache_dtype="int8")
    assert llm.engine.kv_cache.block_num_bytes == INT8_BLOCK_BYTES
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    expected = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    cluster = start_cluster("disaggregated", kv_cache="dtype: int8")
    client = openai.OpenAI(base_url=cluster.base_url, api_key="-", timeout=60, max_retries=0)
    pulled_blocks = 0
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        assert list(result.choices[0].token_ids) == tokens  # type: ignore[attr-defined]
        assert result.usage is not None
        pulled_blocks += -(-result.usage.prompt_tokens // 16)
    generation = [w for w in cluster.wait_idle().workers if w.role == "generation"]
    assert sum(w.prompt_tokens_computed for w in generation) == 0
    # each prompt's blocks once, but those of the shared prefix already in its prefix cache
    pulled = sum(w.kv_bytes_pulled for w in generation)
    assert pulled > 0 and pulled % INT8_BLOCK_BYTES == 0
    assert pulled <= pulled_blocks * INT8_BLOCK_BYTES
