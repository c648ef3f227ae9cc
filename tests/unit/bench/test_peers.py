"""bench/peers.py: its reading of torch profiler tables (the layout vLLM and our workers write),
and the bandwidth bound's bytes per decode step, dense and mixture of experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.profiler import ProfilerActivity, profile

from bench.peers import (
    KvRead,
    StepBytes,
    Target,
    kv_bytes_per_token,
    op_profile,
    step_bytes,
    summarize,
    vllm_kv_cache_gib,
)


def test_a_real_profiler_table_becomes_ms_per_forward_by_op() -> None:
    x, w = torch.randn(4, 64), torch.randn(64, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    with profile(activities=[ProfilerActivity.CPU]) as session:
        for _ in range(10):  # ten "forwards" of three linear layers each
            for _ in range(3):
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").relu_()
    averages = session.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=50)
    self_ms = {e.key: e.self_cpu_time_total / 1000 for e in averages}
    found = op_profile(table, linears_per_forward=3)
    assert found["forwards"] == 10
    top = found["top_ops_ms_per_forward"]
    assert set(top) == set(self_ms) and "mkldnn::_linear_pointwise" in top
    for name, ms in top.items():  # the table rounds to about 3 digits
        assert abs(ms - self_ms[name] / 10) <= 0.01 * self_ms[name] / 10 + 1e-3, name
    total = sum(self_ms.values()) / 10
    assert abs(found["ops_ms_per_forward"] - total) <= 0.01 * total + 1e-3


def test_our_decode_passes_in_c_count_as_one_forward_each() -> None:
    """A decode pass run as one C call shows as `cpu_kernels::decode_step` plus its LM head's
    panel_linear; a prefill pass as 3 linear calls here (linears_per_forward)."""
    from engine.kernels import cpu_kernels

    x, w = torch.randn(4, 64), cpu_kernels.pack_panels(torch.randn(64, 64))
    with profile(activities=[ProfilerActivity.CPU]) as session:
        for _ in range(2):  # two prefill passes
            for _ in range(3):
                cpu_kernels.panel_linear(x, w, None, 64)
        for _ in range(5):  # five decode passes: the C call (a named range), then the LM head
            with torch.profiler.record_function("cpu_kernels::decode_step"):
                x.relu()
            cpu_kernels.panel_linear(x, w, None, 64)
    table = session.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    assert op_profile(table, linears_per_forward=3)["forwards"] == 7


def test_experts_read_is_the_expected_distinct_count_of_random_top_k_routing() -> None:
    """E * (1 - (1 - k/E)^B) against routing simulated as the engine routes: the top k of each
    token's router logits (random here), distinct experts counted per step."""
    weights = StepBytes(weight_bytes=0, dense_bytes=0, expert_bytes=0, num_experts=128, top_k=8)
    generator = torch.Generator().manual_seed(0)
    for batch in (1, 8, 32):
        logits = torch.randn(2000, batch, 128, generator=generator)  # 2,000 steps
        picks = logits.topk(8, dim=-1).indices.reshape(2000, -1)
        hit = torch.zeros(2000, 128).scatter_(1, picks, 1.0).sum(1)
        assert abs(hit.mean().item() - weights.experts_read(batch)) < 0.01 * weights.experts_read(
            batch
        )
    assert weights.experts_read(1) == pytest.approx(8.0)


def test_a_moe_step_reads_the_dense_weights_and_the_selected_share_of_experts(
    tmp_path: Path,
) -> None:
    from tests.unit.tools.test_tiny_arch_bench_moe import SMALL
    from tools.tiny_arch import bench_moe

    bench_moe.build_bench_moe(tmp_path, dtype="bfloat16", sizes=SMALL)
    weights = step_bytes(tmp_path)
    hidden, inter, vocab = SMALL["hidden_size"], SMALL["moe_intermediate_size"], SMALL["vocab_size"]
    experts = 2 * SMALL["num_hidden_layers"] * SMALL["num_experts"] * 3 * hidden * inter
    total = 2 * bench_moe.parameter_count(SMALL)
    assert (weights.weight_bytes, weights.expert_bytes) == (total, experts)
    assert weights.dense_bytes == total - experts - 2 * vocab * hidden  # untied: no embedding
    assert (weights.num_experts, weights.top_k) == (16, 4)
    assert weights.at_batch(1) == pytest.approx(weights.dense_bytes + experts * 4 / 16)
    share = 1 - (1 - 4 / 16) ** 8
    assert weights.at_batch(8) == pytest.approx(weights.dense_bytes + experts * share)
    assert weights.at_batch(1000) == pytest.approx(total - 2 * vocab * hidden)


def test_a_dense_tied_model_reads_every_weight_each_step(tmp_path: Path) -> None:
    tensors = {"model.embed_tokens.weight": torch.zeros(32, 8), "model.norm.weight": torch.ones(8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    weights = step_bytes(tmp_path)
    assert weights.dense_bytes == weights.weight_bytes == 4 * (32 * 8 + 8)
    assert weights.at_batch(1) == weights.at_batch(32) == weights.dense_bytes
    summary = summarize({}, [1, 4], weights, bandwidth=1.0, cache=KvRead(0, 0))
    assert summary["levels"][4]["bandwidth_bound_tokens_per_s"] == round(4e9 / (4 * 264), 1)
    assert "experts_read_per_layer" not in summary["levels"][4]


@pytest.mark.parametrize("dtype, expected", [("bfloat16", 114_688), ("float32", 229_376)])
def test_a_token_holds_k_and_v_of_every_layer_in_the_cache_dtype(
    tmp_path: Path, dtype: str, expected: int
) -> None:
    """Qwen3-0.6B's shape: 28 layers, 8 KV heads of 128 (head_dim apart from hidden / heads)."""
    config = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "hidden_size": 1024}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(Target("m", dtype, tmp_path, dtype)) == expected


@pytest.mark.parametrize(
    "layers, kv_heads, head_dim, expected",
    [(28, 8, 128, 7), (16, 8, 64, 2), (30, 3, 64, 2)],  # Qwen3-0.6B, Llama-3.2-1B, SmolLM2
)
def test_vllm_gets_as_much_kv_cache_as_a_cluster_pool(
    tmp_path: Path, layers: int, kv_heads: int, head_dim: int, expected: int
) -> None:
    """4096 blocks of 16 tokens in bfloat16: Qwen3-0.6B's 7 GiB (vLLM had held 2, four of
    eight 4k prompts), Llama-3.2-1B's 2, and never below the 2 vLLM always had."""
    config = {
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": 1024,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vllm_kv_cache_gib(Target("m", "bfloat16", tmp_path, "bfloat16")) == expected
