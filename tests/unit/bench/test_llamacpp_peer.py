"""bench/llamacpp_peer.py and its part of bench/peers.py: the bound's bytes of a GGUF file, which
systems serve which model, the ratios against llama.cpp, and (when llama.cpp is built on this
machine) a real llama-server answering the load generator's kind of request."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.llamacpp_peer import (
    GGUF_MODELS,
    LLAMACPP_VENV,
    LlamaCppInstall,
    LlamaCppServer,
    amx_host,
    extra_body,
    llama_server_command,
    request_headers,
)
from bench.peers import (
    KvRead,
    StepBytes,
    Target,
    _compared,
    gguf_step_bytes,
    recounted,
    summarize,
    systems_for,
)
from engine.smollm2_model import gguf_path

SMOLLM2_Q4 = "builtin:smollm2-135m-q4"
# Bytes per block of 32 weights, from the GGUF format's block layouts: Q4_1 is an fp16 scale, an
# fp16 minimum and 32 4-bit values; Q8_0 an fp16 scale and 32 int8 values.
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def test_a_gguf_steps_bytes_are_its_quantized_blocks_and_a_tied_embedding_is_streamed() -> None:
    import gguf

    reader = gguf.GGUFReader(gguf_path())
    expected = 0
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        elements = int(np.prod(tensor.shape))
        expected += elements * 4 if kind == "F32" else elements // 32 * BLOCK_BYTES[kind]
    weights = gguf_step_bytes(gguf_path())
    assert weights.weight_bytes == expected
    assert weights.dense_bytes == expected  # no output.weight: the embedding is the LM head
    assert (weights.expert_bytes, weights.num_experts, weights.top_k) == (0, 0, 0)
    assert 90e6 < expected < 100e6  # ~97 MB: the "~90 MB" against 538 MB in float32


def test_a_moe_gguf_splits_experts_and_leaves_an_untied_embedding_out(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_uint32("qwen3moe.expert_count", 8)
    writer.add_uint32("qwen3moe.expert_used_count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((100, 16), np.float32))
    writer.add_tensor("output.weight", np.zeros((100, 16), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), np.float32))
    writer.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((8, 32, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = gguf_step_bytes(path)
    embedding, head, attention, experts = 100 * 16 * 4, 100 * 16 * 4, 16 * 16 * 4, 8 * 32 * 16 * 4
    assert weights == StepBytes(
        weight_bytes=embedding + head + attention + experts,
        dense_bytes=head + attention,
        expert_bytes=experts,
        num_experts=8,
        top_k=2,
    )


def _target(gguf: bool) -> Target:
    if gguf:
        return Target(SMOLLM2_Q4, "q4_1", Path("/unused"), "float32", GGUF_MODELS[SMOLLM2_Q4])
    return Target("builtin:smollm2-135m", "float32", Path("/unused"), "float32")


def test_llama_cpp_serves_gguf_models_and_vllm_checkpoints_the_clusters_both() -> None:
    systems = ["vllm", "llamacpp", "aggregated", "disaggregated"]
    assert systems_for(_target(gguf=True), systems) == ["llamacpp", "aggregated", "disaggregated"]
    assert systems_for(_target(gguf=False), systems) == ["vllm", "aggregated", "disaggregated"]
    assert systems_for(_target(gguf=True), ["llamacpp"]) == ["llamacpp"]


def test_each_server_is_compared_with_each_peer_before_it() -> None:
    assert _compared(["disaggregated", "vllm", "aggregated"]) == [
        ("vllm", "aggregated"),
        ("vllm", "disaggregated"),
    ]
    assert _compared(["aggregated", "llamacpp-python", "llamacpp"]) == [
        ("llamacpp", "llamacpp-python"),
        ("llamacpp", "aggregated"),
        ("llamacpp-python", "aggregated"),
    ]


def test_the_clusters_throughput_and_ttft_are_given_as_multiples_of_llama_cpps() -> None:
    def figures(tok_s: float, ttft_s: float) -> list[dict]:
        return [{"output_tokens_per_s": tok_s, "ttft_p50_s": ttft_s, "itl_p50_s": 0.01}]

    runs = {"llamacpp": {1: figures(100.0, 0.2)}, "aggregated": {1: figures(150.0, 0.1)}}
    weights = StepBytes(int(1e8), int(1e8), 0, 0, 0)
    cache = KvRead(bytes_per_token=1000, context=20_000)  # 20 MB beside the weights
    level = summarize(runs, [1], weights, bandwidth=30.0, cache=cache)["levels"][1]
    assert level["aggregated_vs_llamacpp"] == 1.5
    assert level["aggregated_ttft_vs_llamacpp"] == 0.5
    assert level["bandwidth_bound_tokens_per_s"] == 300.0  # 30 GB/s over 100 MB a step
    assert level["llamacpp"]["fraction_of_bound"] == pytest.approx(100 / 300, abs=1e-3)
    # a 100 MB step at 30 GB/s takes 3.33 ms; a token every 10 ms is 0.333 of that rate
    assert level["llamacpp"]["decode_fraction_of_bound"] == pytest.approx(1 / 3, abs=1e-3)
    # with the cache: 120 MB a step, 4 ms at 30 GB/s, 0.4 of a token every 10 ms
    assert level["llamacpp"]["decode_fraction_of_bound_with_kv"] == pytest.approx(0.4, abs=1e-3)
    assert not any("vllm" in key for key in level)


def test_llama_cpp_python_requests_ban_the_end_tokens_llama_server_reads_ignore_eos() -> None:
    model = GGUF_MODELS[SMOLLM2_Q4]
    assert extra_body("llamacpp-python", model) == {"logit_bias": {"0": -100.0, "2": -100.0}}
    assert extra_body("llamacpp", model) is None


def test_llama_server_runs_one_thread_on_one_core_with_a_slot_per_client() -> None:
    command = llama_server_command(Path("llama-server"), Path("m.gguf"), SMOLLM2_Q4, 8080)
    assert command[:3] == ["taskset", "-c", "0"]
    flags = {flag: command[i + 1] for i, flag in enumerate(command[:-1]) if flag.startswith("--")}
    assert "--cont-batching" in command
    assert flags["--threads"] == flags["--threads-batch"] == "1"
    assert int(flags["--ctx-size"]) // int(flags["--parallel"]) >= 256 + 128
    assert int(flags["--parallel"]) >= 32
    assert ("--no-repack" in command) == amx_host()  # where repacking for AMX crashes it


@pytest.mark.long
@pytest.mark.skipif(
    not (LLAMACPP_VENV / "bin/llama-server").exists() or shutil.which("taskset") is None,
    reason="llama-server is not built here (bench/peers.py --peers llamacpp builds it)",
)
def test_llama_server_serves_the_wheels_gguf_with_eos_ignored_and_counts_its_tokens(
    tmp_path: Path,
) -> None:
    install = LlamaCppInstall(LLAMACPP_VENV / "bin/llama-server", LLAMACPP_VENV / "bin/python")
    server = LlamaCppServer(install, "llamacpp", SMOLLM2_Q4, gguf_path(), tmp_path)
    try:
        body = {"model": SMOLLM2_Q4, "prompt": "The capital of France is", "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        counted = server.tokens_generated()
    finally:
        server.stop()
    assert answer["usage"]["completion_tokens"] == counted == 40
    assert "Paris" in answer["choices"][0]["text"]


def test_a_servers_own_token_count_replaces_the_load_generators() -> None:
    figures = {"output_tokens_per_s": 40.0, "output_tokens_per_request": 100.0, "duration_s": 8.0,
               "completed": 4, "ttft_p50_s": 0.5}  # fmt: skip
    fixed = recounted(figures, 512)
    assert fixed["output_tokens_per_s"] == 64.0
    assert fixed["output_tokens_per_request"] == 128.0
    assert fixed["ttft_p50_s"] == 0.5


@pytest.mark.long
@pytest.mark.skipif(
    not (LLAMACPP_VENV / "lib").exists()
    or not any(LLAMACPP_VENV.glob("lib/python*/site-packages/llama_cpp/server/app.py")),
    reason="llama-cpp-python[server] is not built here (bench/peers.py --peers llamacpp-python)",
)
def test_llama_cpp_python_takes_the_load_generators_request_ids_and_ignores_eos(
    tmp_path: Path,
) -> None:
    install = LlamaCppInstall(LLAMACPP_VENV / "bin/llama-server", LLAMACPP_VENV / "bin/python")
    server = LlamaCppServer(install, "llamacpp-python", SMOLLM2_Q4, gguf_path(), tmp_path)
    try:
        body = {"model": SMOLLM2_Q4, "prompt": "Hello", "max_tokens": 40, "temperature": 0,
                **(extra_body("llamacpp-python", GGUF_MODELS[SMOLLM2_Q4]) or {})}  # fmt: skip
        headers = {"x-request-id": "benchmark-serving0"}  # vllm bench serve's, not a UUID
        answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    finally:
        server.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 40
    assert request_headers("llamacpp-python") is None


def test_a_gguf_builtins_directory_holds_the_file_llama_cpp_serves(tmp_path: Path) -> None:
    from bench.llamacpp_peer import gguf_file

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="0 .gguf files"):
        gguf_file(tmp_path)
    (tmp_path / "model.q8_0.gguf").write_bytes(b"GGUF")
    assert gguf_file(tmp_path) == tmp_path / "model.q8_0.gguf"
