"""The engine with kv_cache_dtype bfloat16 and int8 on the tiny model, against Hugging Face's
forward whose attention reads K and V rounded or quantized the same way (a custom attention
function around its SDPA one): the prompt's log-probs, and greedy continuations (decode steps,
through the C decode step or the torch path) token for token with their log-probs. Against
auto the logprobs differ by what the cache's rounding costs, within a bound; a bfloat16 cache
under a bfloat16 model is auto's cache and gives auto's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.kernels import kv_quant
from engine.llm import LLM
from tools.tiny_model.build import TEST_PROMPTS

ROOT = Path(__file__).resolve().parents[3]
KV_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "int8": torch.int8}
MAX_TOKENS = 12
# float32 maths on the same cache values, summed in other orders: as test_prompt_logprobs.py.
# int8: the engine's K and V and HF's differ by float32 rounding (~1e-6), so now and then a
# value that close to a step boundary rounds to the neighbouring step on one side (one step of
# its row, max|row| / 127): measured up to 3e-4 in a log-prob.
SAME_CACHE_TOLERANCE = {"bfloat16": 1e-4, "int8": 1e-3}
# Against auto's float32 cache, the mean |delta logprob| over the prompts' tokens. bfloat16 keeps
# 8 bits of mantissa (a relative error up to 2^-9 per value), int8 a step of max|row| / 127 (up
# to 1/254 of the row's largest value): measured on this model about 1e-3 and 4e-3 (bench/
# README.md has SmolLM2's). The bounds are 10x that: a wrong scale or a misread row moves
# logprobs by whole units.
MEAN_DELTA_BOUND = {"bfloat16": 0.01, "int8": 0.04}

_ROUNDING: dict[str, torch.dtype | None] = {"dtype": None}


def _attention_over_the_cache(module: Any, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    """HF's SDPA attention over K and V as a cache of _ROUNDING["dtype"] holds them: key and
    value are (batch, kv_heads, tokens, head_dim), one cache row per (token, kv head)."""
    dtype = _ROUNDING["dtype"]
    if dtype is not None:
        key = kv_quant.as_float(kv_quant.to_cache(key, dtype)).to(query.dtype)
        value = kv_quant.as_float(kv_quant.to_cache(value, dtype)).to(query.dtype)
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


AttentionInterface.register("pdcluster_kv_cache_dtype", _attention_over_the_cache)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_path, dtype=torch.float32, attn_implementation="pdcluster_kv_cache_dtype"
    ).eval()


def hf_logprobs(model: Any, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """log-softmax at every position of ids, with the cache's rounding of K and V."""
    _ROUNDING["dtype"] = KV_DTYPES[kv_dtype]
    try:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    finally:
        _ROUNDING["dtype"] = None


@pytest.fixture(scope="module")
def prompts(tiny_model_path: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return [tokenizer(" ".join(TEST_PROMPTS[i : i + 3])).input_ids for i in range(0, 9, 3)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_prompt_and_greedy_logprobs_are_hf_reading_the_same_cache(
    tiny_model_path: Path, hf_model: Any, prompts: list[list[int]], kv_dtype: str, backend: str
) -> None:
    llm = LLM(
        str(tiny_model_path), num_blocks=256, kv_cache_dtype=kv_dtype, attention_backend=backend
    )
    assert llm.engine.kv_cache.pool.dtype == KV_DTYPES[kv_dtype]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, prompt_logprobs=0)
    for ids, result in zip(prompts, llm.generate(prompts, params), strict=True):
        out = result.outputs[0]
        full = ids + out.token_ids
        reference = hf_logprobs(hf_model, full, kv_dtype)
        expected = reference[torch.arange(len(full) - 1), torch.tensor(full[1:])]
        assert result.prompt_logprobs is not None
        got = [lp for lp, _ in result.prompt_logprobs] + out.logprobs
        assert got == pytest.approx(expected.tolist(), abs=SAME_CACHE_TOLERANCE[kv_dtype])
        # greedy: each generated token is the reference's best (or within the tolerance of it)
        best = reference[len(ids) - 1 : -1].max(dim=-1).values
        assert out.logprobs == pytest.approx(best.tolist(), abs=SAME_CACHE_TOLERANCE[kv_dtype])


def test_against_auto_the_cache_costs_a_bounded_logprob_difference(
    tiny_model_path: Path, prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    logprobs = {}
    for kv_dtype in ("auto", "bfloat16", "int8"):
        llm = LLM(str(tiny_model_path), num_blocks=256, kv_cache_dtype=kv_dtype)
        results = llm.generate(prompts, params)
        logprobs[kv_dtype] = torch.tensor(
            [lp for r in results for lp, _ in r.prompt_logprobs or []]
        )
    for kv_dtype in ("bfloat16", "int8"):
        mean = float((logprobs[kv_dtype] - logprobs["auto"]).abs().mean())
        assert 0 < mean < MEAN_DELTA_BOUND[kv_dtype], (kv_dtype, mean)


def test_a_bfloat16_cache_under_a_bfloat16_model_is_autos(tiny_model_path: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    runs = []
    for kv_dtype in ("auto", "bfloat16"):
        llm = LLM(str(tiny_model_path), dtype="bfloat16", num_blocks=64, kv_cache_dtype=kv_dtype)
        assert llm.engine.kv_cache.pool.dtype == torch.bfloat16
        runs.append([(r.outputs[0].token_ids, r.outputs[0].logprobs)
                     for r in llm.generate(TEST_PROMPTS[:3], params)])  # fmt: skip
    assert runs[0] == runs[1]


def test_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, bfloat16 or int8"):
        EngineConfig(model="builtin:tiny", kv_cache_dtype="fp8")  # type: ignore[arg-type]
    assert EngineConfig(model="builtin:tiny", dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    assert EngineConfig(model="builtin:tiny", kv_cache_dtype="int8").kv_torch_dtype == torch.int8


TRITON_CHILD = """
import json, sys
from common.sampling_params import SamplingParams
from engine.llm import LLM
model, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=0)
out = {}
for kv_dtype in ("bfloat16", "int8"):
    llm = LLM(model, attention_backend="triton", block_size=4, max_num_batched_tokens=12,
              num_blocks=128, kv_cache_dtype=kv_dtype)
    out[kv_dtype] = [(r.outputs[0].token_ids, r.outputs[0].logprobs)
                     for r in llm.generate(prompts, params)]
print(json.dumps(out))
"""


@pytest.mark.long  # the interpreter: about a minute
def test_the_triton_kernels_store_and_read_the_cache_as_the_c_kernels(
    tiny_model_path: Path,
) -> None:
    """The engine on the Triton kernels (interpreted, in a child process: the interpreter is
    chosen when triton is first imported), chunked prefill over small blocks: the C path's
    greedy tokens and log-probs with the same cache dtype."""
    prompts, max_new = TEST_PROMPTS[:2], 6
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", TRITON_CHILD, str(tiny_model_path), json.dumps(prompts),
         str(max_new)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    triton_runs = json.loads(child.stdout.strip().splitlines()[-1])
    params = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=0)
    for kv_dtype, runs in triton_runs.items():
        llm = LLM(str(tiny_model_path), block_size=4, num_blocks=128, kv_cache_dtype=kv_dtype)
        for (tokens, logprobs), result in zip(runs, llm.generate(prompts, params), strict=True):
            assert tokens == result.outputs[0].token_ids, kv_dtype
            tolerance = SAME_CACHE_TOLERANCE[kv_dtype]
            assert logprobs == pytest.approx(result.outputs[0].logprobs, abs=tolerance)
