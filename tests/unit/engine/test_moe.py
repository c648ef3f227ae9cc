"""A mixture-of-experts layer reads each expert's weights once per engine step, however many of the
step's tokens were routed to it: counted by cpu_moe.c's expert_passes (the C path) and by the
torch path's own counter, against the distinct experts the router picked in that step."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.kernels import cpu_kernels
from engine.llm import LLM
from engine.models.moe import SparseMoE
from tests.unit.engine.test_architectures import tiny_arch_path
from tools.tiny_model.build import TEST_PROMPTS


def distinct_experts_per_step(llm: LLM) -> tuple[list[int], list[int], list[int]]:
    """Run 8 prompts together; per engine step: (tokens through each MoE layer, distinct
    experts picked summed over the layers, expert weight passes counted)."""
    picked: list[torch.Tensor] = []
    original = SparseMoE.route

    def route(self: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = original(self, x)
        picked.append(ids)  # (tokens, top_k)
        return ids, weights

    params = SamplingParams(max_tokens=6, temperature=0.0)
    for i, prompt in enumerate(TEST_PROMPTS[:8]):
        llm.engine.add_request(f"r{i}", llm.tokenizer.encode(prompt), params)
    num_layers = llm.engine.model_config.num_layers
    tokens, distinct, passes = [], [], []
    SparseMoE.route = route  # type: ignore[method-assign]
    try:
        while llm.engine.has_unfinished():
            picked.clear()
            before = counter(llm)
            llm.engine.step()
            passes.append(counter(llm) - before)
            tokens.append(sum(ids.shape[0] for ids in picked) // num_layers)
            distinct.append(sum(int(ids.unique().numel()) for ids in picked))
    finally:
        SparseMoE.route = original  # type: ignore[method-assign]
    return tokens, distinct, passes


def counter(llm: LLM) -> int:
    if llm.engine.expert_kernel == "c":
        return cpu_kernels.expert_passes()
    return sum(m.expert_passes for m in llm.engine.model.modules() if isinstance(m, SparseMoE))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_each_expert_is_read_once_per_step_not_once_per_token(backend: str) -> None:
    llm = LLM(str(tiny_arch_path("qwen3-moe")), num_blocks=128, attention_backend=backend)
    assert llm.engine.expert_kernel == ("c" if backend == "auto" else "torch")
    # the router runs in Python here, where the test sees its picks; the one-call C decode step
    # routes in C: test_cpu_decode_step.py counts its reads against the same picks
    llm.engine.model.c_decode_max_rows = 0
    tokens, distinct, passes = distinct_experts_per_step(llm)
    assert passes == distinct
    # 8 sequences decoding together, top 4 of 16 experts: fewer reads than (token, expert) pairs
    moe = llm.engine.model_config.moe
    assert moe is not None
    decode_steps = [i for i, n in enumerate(tokens) if n == 8]
    assert decode_steps, tokens
    for i in decode_steps:
        assert passes[i] < 8 * moe.top_k * llm.engine.model_config.num_layers
