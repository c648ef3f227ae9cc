"""The prompt's own log-probs (what scoring harnesses read through echo): equal to Hugging Face's
log-softmax of the prompt, whole or in prefill chunks, warm prefix cache or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tools.tiny_model.build import TEST_PROMPTS

PROMPT = " ".join(TEST_PROMPTS[:4])


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_path: Path) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and HF's log-softmax at every position, float32."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("chunk", [2048, 7], ids=["whole", "chunks-of-7"])
def test_prompt_logprobs_match_hf(tiny_model_path: Path, hf_logprobs, chunk: int) -> None:
    ids, reference = hf_logprobs
    llm = LLM(str(tiny_model_path), num_blocks=256, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3, n=2)
    for attempt in range(2):  # the second run finds the prompt in the prefix cache
        (result,) = llm.generate([ids], params)
        assert result.prompt_logprobs is not None, attempt
        assert len(result.prompt_logprobs) == len(ids) - 1
        for position, (logprob, top) in enumerate(result.prompt_logprobs):
            expected = reference[position, ids[position + 1]].item()
            assert logprob == pytest.approx(expected, abs=1e-4), (attempt, position)
            best = torch.topk(reference[position], 3)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_without_prompt_logprobs_nothing_extra_comes_back(tiny_model_path: Path) -> None:
    llm = LLM(str(tiny_model_path), num_blocks=64)
    (result,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2))
    assert result.prompt_logprobs is None
