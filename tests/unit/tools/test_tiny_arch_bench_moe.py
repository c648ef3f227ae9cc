"""builtin:qwen3-moe-bench's builder (tools/tiny_arch/bench_moe.py), built at a scaled-down size:
transformers' Qwen3MoeForCausalLM loads what it writes with no tensor missing or left over, the
parameters are the architecture's formula, shards carry Hugging Face's index, the build is
deterministic, and the engine serves it as transformers runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.sampling_params import SamplingParams
from tools.tiny_arch import bench_moe, random_checkpoint
from tools.tiny_model.build import TEST_PROMPTS, VOCAB_SIZE

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "vocab_size": VOCAB_SIZE,
}


def _stored(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


def test_the_benchmark_size_is_qwen3_30b_a3b_routing_at_a_few_hundred_million() -> None:
    shapes = bench_moe.tensor_shapes(bench_moe.SIZES)
    count = sum(torch.Size(shape).numel() for shape in shapes.values())
    assert count == bench_moe.parameter_count(bench_moe.SIZES) == 472_659_712
    assert (bench_moe.SIZES["num_experts"], bench_moe.SIZES["num_experts_per_tok"]) == (128, 8)
    assert len([n for n in shapes if n.endswith("experts.127.down_proj.weight")]) == 8


def test_transformers_loads_every_tensor_and_counts_the_formula(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    bench_moe.build_bench_moe(tmp_path, dtype="float32", sizes=SMALL)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["norm_topk_prob"] is True
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_experts == 16 and model.config.num_experts_per_tok == 4
    expected = bench_moe.parameter_count(SMALL)
    assert sum(p.numel() for p in model.parameters()) == expected
    stored = _stored(tmp_path)
    assert sum(t.numel() for t in stored.values()) == expected
    assert {n: tuple(t.shape) for n, t in stored.items()} == bench_moe.tensor_shapes(SMALL)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()


def test_weights_are_deterministic_and_bfloat16_is_float32_rounded(tmp_path: Path) -> None:
    bench_moe.build_bench_moe(tmp_path / "a", dtype="float32", sizes=SMALL)
    bench_moe.build_bench_moe(tmp_path / "b", dtype="float32", sizes=SMALL)
    bench_moe.build_bench_moe(tmp_path / "c", dtype="bfloat16", sizes=SMALL)
    a, b, c = (_stored(tmp_path / d) for d in "abc")
    assert a.keys() == b.keys() == c.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name
        assert c[name].dtype == torch.bfloat16 and torch.equal(tensor.bfloat16(), c[name]), name
    # fan_in ** -0.5: an expert's down projection reads moe_intermediate_size
    down = a["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert abs(down.std().item() - 32**-0.5) < 0.02
    assert json.loads((tmp_path / "c/config.json").read_text())["torch_dtype"] == "bfloat16"


def test_large_checkpoints_are_sharded_with_an_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 1 << 20)
    bench_moe.build_bench_moe(tmp_path, dtype="float32", sizes=SMALL)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(bench_moe.tensor_shapes(SMALL))
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == 4 * bench_moe.parameter_count(SMALL)
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_engine_serves_it_as_transformers_runs_it(tmp_path: Path) -> None:
    from engine.llm import LLM
    from tests.unit.engine.test_architectures import hf_greedy_ids

    bench_moe.build_bench_moe(tmp_path, dtype="float32", sizes=SMALL)
    prompts = TEST_PROMPTS[:3]
    expected = hf_greedy_ids(tmp_path, prompts, max_new_tokens=8)
    llm = LLM(str(tmp_path), num_blocks=64)
    results = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [r.outputs[0].token_ids for r in results] == expected
