"""The engine's attention dispatch end to end through the Triton kernels (interpreted on CPU).

The interpreter must be switched on before triton is first imported, so the engine runs in a child
process with TRITON_INTERPRET=1; its greedy tokens are compared with Hugging Face `generate` here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tools.tiny_model.build import TEST_PROMPTS

ROOT = Path(__file__).resolve().parents[3]
MAX_NEW = 8

CHILD = """
import json, sys
from common.sampling_params import SamplingParams
from engine.llm import LLM
model, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
# Small blocks and a small token budget: chunked prefill over cached prefixes, many-block decodes.
llm = LLM(model, attention_backend="triton", block_size=4, max_num_batched_tokens=12)
params = SamplingParams(temperature=0.0, max_tokens=max_new)
cold = llm.generate(prompts, params)
warm = llm.generate(prompts, params)
kernels = {m.kernel for m in llm.engine.model.modules() if hasattr(m, "kernel")}
assert kernels <= {"triton"}, kernels
print(json.dumps({
    "cold": [r.outputs[0].token_ids for r in cold],
    "warm": [r.outputs[0].token_ids for r in warm],
    "warm_cached_tokens": [r.num_cached_tokens for r in warm],
    "used_blocks": llm.engine.kv.usage.used,
}))
"""


def test_triton_backend_engine_matches_hf_generate(tiny_model_path: Path) -> None:
    prompts = TEST_PROMPTS[:3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_model_path), json.dumps(prompts), str(MAX_NEW)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
        expected.append(out[0, ids.shape[1] :].tolist())
    assert result["cold"] == expected
    assert result["warm"] == expected
    assert all(n > 0 for n in result["warm_cached_tokens"])
    assert result["used_blocks"] == 0


@pytest.mark.parametrize("arch", ["qwen3-moe", pytest.param("gpt-oss", marks=pytest.mark.long)])
def test_triton_backend_runs_the_mixture_of_experts_architectures(arch: str) -> None:
    """The GPU path of a MoE model: experts through kernels/moe.py's grouped matmuls, gpt-oss's
    sinks and windows through the attention kernels; greedy tokens as transformers'."""
    from tests.unit.engine.test_architectures import hf_greedy_ids, tiny_arch_path

    path = tiny_arch_path(arch)
    prompts = TEST_PROMPTS[:2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), json.dumps(prompts), str(MAX_NEW)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    expected = hf_greedy_ids(path, prompts, MAX_NEW)
    assert result["cold"] == expected and result["warm"] == expected
    assert result["used_blocks"] == 0
