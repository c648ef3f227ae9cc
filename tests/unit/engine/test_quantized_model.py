"""A GGUF served as stored: builtin:smollm2-135m-q4 (the wheel's Q4_1 file, its linear layers
kept 4-bit and run by cpu_quant.c) computes the model its blocks dequantize to, which is the
float32 builtin (transformers' dequantization of the same file): the same greedy tokens and
log-probs to summation order. Needs both builds (~35 s the first time): `long`."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.kernels import cpu_kernels, cpu_quant
from engine.linear import Linear
from engine.llm import LLM

pytestmark = pytest.mark.long

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colours are",
]


def greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    results = llm.generate(PROMPTS, params)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[int], list[float]]]:
    """The dequantized model in float32: what every variant approximates."""
    return greedy(LLM("builtin:smollm2-135m", dtype="float32"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_the_q4_gguf_runs_quantized_and_computes_its_dequantized_model(
    dtype: str, int8_activations: bool, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 float activations: the dequantized model to summation order. bfloat16
    activations or int8 ones (prefill's rows; as llama.cpp multiplies Q4_1 by Q8_1
    activations): the same first tokens, log-probs within their rounding. Measured against the
    float32 model on a Sapphire Rapids VM: the bfloat16 float model itself moves these
    log-probs by up to 0.03 mean / 0.10 max (oneDNN's bfloat16 kernels differ by CPU: against
    the bfloat16 model, as this test compared before, 4-bit's difference reached 0.061 here),
    the 4-bit bfloat16 one by up to 0.04 / 0.12 (int8 activations) and 0.03 / 0.08 (float)."""
    if int8_activations and not cpu_quant.int8_available():
        pytest.skip("these kernels have no int8 activation path (AVX2 or later)")
    monkeypatch.setattr(cpu_quant, "INT8_MIN_ROWS", 4 if int8_activations else 1 << 30)
    quantized = LLM("builtin:smollm2-135m-q4", dtype=dtype)
    layers = [m for m in quantized.engine.model.modules() if isinstance(m, Linear)]
    if cpu_kernels.library() is not None:  # every matrix 4-bit but the tied head (Q8_0)
        assert all(m.layout == "quantized" for m in layers)
        assert quantized.engine.model.lm_head.packed.bits == 8
        assert quantized.engine.model.c_decode_max_rows > 0  # decode: the one-call C step
    # float32 and float activations: summation order only; else the rounding of bfloat16
    # activations or of int8 ones: the docstring's figures' bounds on the largest |difference|
    # and on their mean over every token compared (all prompts': a prompt whose greedy tokens
    # part after one token would make its own mean that one token's; on a Zen 4 VM one did, by
    # 0.060, where the mean over all 27 was 0.026)
    exact = dtype == "float32" and not int8_activations
    max_diff, mean_diff = (2e-3, 2e-3) if exact else (0.3, 0.06)
    same, diffs = 0, []
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(greedy(quantized), reference, strict=True):
        same += ids == ref_ids
        pairs = enumerate(zip(ids, ref_ids, strict=False))  # up to the first difference
        common = next((i for i, (a, b) in pairs if a != b), min(len(ids), len(ref_ids)))
        diff = (torch.tensor(logprobs[:common]) - torch.tensor(ref_logprobs[:common])).abs()
        assert common > 0 and diff.max() <= max_diff, (ids, ref_ids)
        diffs.append(diff)
    assert torch.cat(diffs).mean() <= mean_diff
    if exact:  # else how many stay identical is measured, not held (bench/README.md)
        assert same == len(PROMPTS)
