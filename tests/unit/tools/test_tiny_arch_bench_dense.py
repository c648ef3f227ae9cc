"""The realistic-size benchmark builtins (tools/tiny_arch/bench_dense.py): the full shapes give the
real models' parameter counts; built scaled down, transformers loads every tensor, the grown
tokenizer decodes and re-encodes its filler ids, and the engine serves each as transformers
runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.builtin_models import BUILTIN_MODELS
from common.sampling_params import SamplingParams
from tools.tiny_arch import bench_dense

SMALL = bench_dense.SMALL
PROMPTS = ["The quick brown fox", "def main():\n    return"]


def test_the_full_shapes_are_the_real_models_parameter_counts() -> None:
    for name, shape in bench_dense.SHAPES.items():
        config = bench_dense.model_config(shape, "bfloat16")
        shapes = bench_dense.tensor_shapes(shape, config)
        assert sum(torch.Size(s).numel() for s in shapes.values()) == shape.parameters, name
        assert f"builtin:{name}-bench" in BUILTIN_MODELS
    assert bench_dense.SHAPES["llama-3.2-1b"].config["vocab_size"] == 128256


@pytest.mark.parametrize("name", sorted(bench_dense.SHAPES))
def test_built_small_it_loads_in_transformers_and_the_engine_matches_it(
    name: str, tmp_path: Path, smollm2_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.llm import LLM
    from tests.unit.engine.test_architectures import hf_greedy_ids

    bench_dense.build_dense_bench(tmp_path, name, dtype="float32", overrides=SMALL)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == bench_dense.SHAPES[name].config["model_type"]
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == SMALL["vocab_size"]
    last = SMALL["vocab_size"] - 1
    text = tokenizer.decode([last, 100, bench_dense.SMOLLM2_VOCAB])
    assert tokenizer.encode(text, add_special_tokens=False) == [last, 100, 49152]

    expected = hf_greedy_ids(tmp_path, PROMPTS, max_new_tokens=8)
    llm = LLM(str(tmp_path), num_blocks=64)
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    assert [r.outputs[0].token_ids for r in results] == expected
