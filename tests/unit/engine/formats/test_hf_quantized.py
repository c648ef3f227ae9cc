"""Hugging Face checkpoints quantized weight-only (compressed-tensors, GPTQ, AWQ), read without
loss: every quantized linear's QuantizedWeight dequantizes to exactly the float32 weights the
format's reference gives (compressed-tensors' own decompression; for GPTQ / AWQ an element-by-
element unpacking written from the formats' descriptions: hf_quant_files.py), and the engine
serving the quantized checkpoint (its linear layers kept quantized, run by cpu_quant.c) gives the
greedy tokens of the same engine on a float32 checkpoint of those weights. What is not read is
refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.formats.hf_quant import read_quantized
from engine.kernels import cpu_kernels, cpu_quant
from engine.linear import Linear
from engine.llm import LLM
from engine.models import read_model_config
from engine.quant.weight import QuantizedWeight
from tests.unit.engine.formats.hf_quant_files import (
    AWQ_ORDER,
    LINEAR,
    Quantized,
    compressed_tensors_checkpoint,
    decompress_in_stored_dtype,
    gptq_like_checkpoint,
    pack_awq,
    pack_gptq,
    source_state,
    write_checkpoint,
)
from tools.tiny_model.build import TEST_PROMPTS

PROMPTS = [*TEST_PROMPTS[:4], " ".join(TEST_PROMPTS)]
MAX_NEW = 20

# (bits, symmetric, strategy, group_size, format, dynamic int8 activations)
CT_VARIANTS = {
    "w4-sym-group32": (4, True, "group", 32, "pack-quantized", False),
    "w4-asym-group32": (4, False, "group", 32, "pack-quantized", False),
    "w4-sym-channel": (4, True, "channel", None, "pack-quantized", False),
    "w4-asym-channel": (4, False, "channel", None, "pack-quantized", False),
    "w8-sym-channel": (8, True, "channel", None, "pack-quantized", False),
    "w8-sym-group32": (8, True, "group", 32, "pack-quantized", False),
    "w8-naive-channel": (8, True, "channel", None, "naive-quantized", False),
    "w8-naive-tensor": (8, True, "tensor", None, "naive-quantized", False),
    "w8a8-int-channel": (8, True, "channel", None, "int-quantized", True),
    "w4-naive-asym-group32": (4, False, "group", 32, "naive-quantized", False),
}
# (method, bits, group_size, symmetric, v1 zeros)
GPTQ_VARIANTS = {
    "gptq-w4-sym-group32-v1": ("gptq", 4, 32, True, True),
    "gptq-w4-asym-group32-v1": ("gptq", 4, 32, False, True),
    "gptq-w4-asym-channel-v2": ("gptq", 4, -1, False, False),
    "gptq-w8-sym-channel-v1": ("gptq", 8, -1, True, True),
    "gptq-w8-sym-group32-v2": ("gptq", 8, 32, True, False),
    "awq-w4-group32": ("awq", 4, 32, False, False),
    "awq-w4-group64": ("awq", 4, 64, False, False),
}


@pytest.fixture(scope="module")
def source() -> Path:
    from engine.builtin_build import ensure_builtin

    return ensure_builtin("builtin:tiny-mistral")


@pytest.fixture(scope="module")
def state(source: Path) -> dict[str, torch.Tensor]:
    return source_state(source)


def quantize(state: dict[str, torch.Tensor], variant: str) -> Quantized:
    if variant in CT_VARIANTS:
        bits, symmetric, strategy, group_size, fmt, activations = CT_VARIANTS[variant]
        return compressed_tensors_checkpoint(
            state, bits, symmetric, strategy, group_size, fmt, activations
        )
    method, bits, group_size, symmetric, v1 = GPTQ_VARIANTS[variant]
    return gptq_like_checkpoint(state, method, bits, group_size, symmetric, v1)


def read_back(source: Path, out: Path, quantized: Quantized) -> dict:
    path = write_checkpoint(source, out, quantized.tensors, quantized.qconfig)
    return read_quantized(path, json.loads((path / "config.json").read_text()), torch.float32)


@pytest.mark.parametrize("variant", [*CT_VARIANTS, *GPTQ_VARIANTS])
def test_each_quantized_linear_dequantizes_to_the_formats_float32_weights(
    variant: str, source: Path, state: dict, tmp_path: Path
) -> None:
    quantized = quantize(state, variant)
    read = read_back(source, tmp_path, quantized)
    bits = (
        quantized.qconfig.get("bits")
        or quantized.qconfig["config_groups"]["group_0"]["weights"]["num_bits"]
    )
    for name, weight in state.items():
        if not LINEAR.search(name):
            assert read[name].dtype == torch.float32 and torch.equal(read[name], weight), name
            continue
        matrix = read[name]
        assert isinstance(matrix, QuantizedWeight) and matrix.bits == bits, name
        assert torch.equal(matrix.dequantize(), quantized.reference[name]), name
        if variant in CT_VARIANTS:  # and the library's own result in the stored bfloat16
            module = name.removesuffix(".weight")
            stored = decompress_in_stored_dtype(quantized, module)
            assert stored.dtype == torch.bfloat16
            assert torch.equal(matrix.dequantize().to(torch.bfloat16), stored), name


def test_packed_words_follow_the_published_layouts() -> None:
    """The test's own packers (and so its references) against the layouts as published: GPTQ
    puts input channels 0..7 of a column in one word low nibble first (0x76543210); AWQ puts
    columns 0..7 in the order 0, 2, 4, 6, 1, 3, 5, 7 (0x75316420)."""
    assert AWQ_ORDER == [0, 2, 4, 6, 1, 3, 5, 7]
    values = [list(range(8))]  # one column (GPTQ: its K) / one row of 8 columns (AWQ)
    gptq = pack_gptq(values, [[8]], torch.ones(1, 1).half(), bits=4, v1=True)
    assert gptq["qweight"].tolist() == [[0x76543210]]
    assert gptq["qzeros"].tolist() == [[7]]  # zero 8 stored minus one
    by_column = [[v] for v in range(8)]  # 8 columns, K = 1
    awq = pack_awq(by_column, [[0]] * 8, torch.ones(8, 1).half())
    assert awq["qweight"].tolist() == [[0x75316420]]


def greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=0)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in llm.generate(PROMPTS, params)]


SERVED = ["w4-sym-group32", "w4-asym-channel", "w8-sym-channel", "w8a8-int-channel",
          "gptq-w4-sym-group32-v1", "gptq-w4-asym-group32-v1", "gptq-w8-sym-channel-v1",
          "awq-w4-group32"]  # fmt: skip


def as_kernel_holds_it(matrix: QuantizedWeight) -> torch.Tensor:
    """The float32 matrix cpu_quant.c multiplies by: its blocks keep scales and mins in float16
    (exact for these files' scales, and for symmetric files' mins, -8 scale or none)."""
    mins = None if matrix.mins is None else matrix.mins.half().float()
    scales = matrix.scales.half().float()
    return QuantizedWeight(matrix.bits, matrix.group_size, matrix.values, scales, mins).dequantize()


@pytest.mark.parametrize("variant", SERVED)
def test_the_engine_serves_the_checkpoint_as_its_dequantized_float32_model(
    variant: str, source: Path, state: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float activations (int8 ones round): the quantized layers compute the float32 model of
    the reference weights, to summation order where the file is symmetric. With zero points,
    cpu_quant.c's float16 mins (-scale * zero to 11 bits) move log-probs by up to ~3e-3 here;
    against the float model of exactly what the kernel holds, summation order again."""
    monkeypatch.setattr(cpu_quant, "INT8_MIN_ROWS", 1 << 30)
    quantized = quantize(state, variant)
    path = write_checkpoint(source, tmp_path / "quantized", quantized.tensors, quantized.qconfig)
    llm = LLM(str(path), num_blocks=128)
    layers = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, Linear)}
    if cpu_kernels.library() is not None:  # all but the float LM head ("ignore": lm_head)
        assert {n for n, m in layers.items() if m.layout != "quantized"} == {"lm_head"}
    outputs = greedy(llm)
    read = read_quantized(path, json.loads((path / "config.json").read_text()), torch.float32)
    exact = all(m.mins is None or torch.equal(m.mins.half().float(), m.mins)
                for m in read.values() if isinstance(m, QuantizedWeight))  # fmt: skip
    references = {"dequantized": (quantized.reference, 1e-4 if exact else 1e-2)}
    if not exact:
        held = {n: as_kernel_holds_it(m) for n, m in read.items() if isinstance(m, QuantizedWeight)}
        references["as the kernel holds it"] = (held, 1e-4)
    for kind, (weights, tolerance) in references.items():
        float_state = {n: weights.get(n, t) for n, t in state.items()}
        float_path = write_checkpoint(source, tmp_path / kind, float_state)
        for (ids, logprobs), (ref_ids, ref_logprobs) in zip(
            outputs, greedy(LLM(str(float_path), num_blocks=128)), strict=True
        ):
            assert ids == ref_ids, kind
            diff = (torch.tensor(logprobs) - torch.tensor(ref_logprobs)).abs().max()
            assert diff <= tolerance, (kind, float(diff))
    assert exact == ("-sym-" in variant or "w8" in variant)


def test_transformers_reads_the_compressed_tensors_checkpoint_as_the_engine_does(
    source: Path, state: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is a real one: transformers loads it through compressed-tensors, its
    decompressed linear weights are the QuantizedWeights' values, and its greedy tokens the
    engine's. Symmetric: transformers 5.25 with compressed-tensors 0.20 re-initialises packed
    zero points at load (llm-compressor issue 1618), so asymmetric files are held to the
    package's decompression alone (above)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(cpu_quant, "INT8_MIN_ROWS", 1 << 30)
    quantized = quantize(state, "w4-sym-group32")
    read = read_back(source, tmp_path, quantized)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    expected = []
    for prompt in PROMPTS:  # the first forward decompresses (compressed-tensors' hook)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)
        expected.append(out[0, ids.shape[1] :].tolist())
    weights = dict(model.named_parameters())
    for name in [n for n in state if LINEAR.search(n)]:
        assert torch.equal(read[name].dequantize(), weights[name]), name
    assert [ids for ids, _ in greedy(LLM(str(tmp_path), num_blocks=128))] == expected


def write_config(tmp_path: Path, qconfig: dict) -> Path:
    config = {"model_type": "llama", "vocab_size": 8, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "quantization_config": qconfig}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


CT_GROUP = {"targets": ["Linear"], "format": None, "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128,
                        "strategy": "group", "dynamic": False}}  # fmt: skip


def ct_config(weights: dict | None = None, **extra: object) -> dict:
    group = {**CT_GROUP, "weights": {**CT_GROUP["weights"], **(weights or {})}}
    for key in ("input_activations", "format"):
        if key in extra:
            group[key] = extra.pop(key)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": group}, **extra}  # fmt: skip


@pytest.mark.parametrize(
    "qconfig, says",
    [
        ({"quant_method": "mxfp4"}, r"quantized checkpoints \(mxfp4\) are not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"\(fp8\) are not supported"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"\(bitsandbytes\)"),
        (ct_config(format="float-quantized"), "format 'float-quantized' is not supported"),
        (ct_config({"type": "float", "num_bits": 8}), "float8 weights are not supported"),
        (ct_config({"strategy": "block", "block_structure": [128, 128]}), "'block'"),
        (ct_config(kv_cache_scheme={"num_bits": 8, "type": "float"}), "quantized KV cache"),
        (
            ct_config(input_activations={"num_bits": 8, "type": "int", "dynamic": False}),
            "static or float activation",
        ),  # fmt: skip
        (ct_config(sparsity_config={"format": "sparse-24-bitmask"}), "sparse checkpoints"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
    ],
)
def test_what_is_not_read_is_refused_in_one_line(tmp_path: Path, qconfig: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says) as refused:
        read_model_config(write_config(tmp_path, qconfig))
    assert "\n" not in str(refused.value)


def test_desc_act_is_read_where_its_groups_are_the_plain_ones_and_refused_where_permuted(
    source: Path, state: dict, tmp_path: Path
) -> None:
    quantized = gptq_like_checkpoint(state, "gptq", bits=4, group_size=32)
    quantized.qconfig["desc_act"] = True
    read_back(source, tmp_path / "plain", quantized)  # g_idx = k // 32: read as any other
    name = "model.layers.1.mlp.down_proj.g_idx"
    permuted = quantized.tensors[name].flip(0).contiguous()  # act-order: channels reordered
    quantized.tensors[name] = permuted
    with pytest.raises(ValueError, match=r"mlp.down_proj: act-order \(desc_act\)") as refused:
        read_back(source, tmp_path / "permuted", quantized)
    assert "\n" not in str(refused.value)


def test_8_bit_zero_points_that_leave_int8_are_refused(
    source: Path, state: dict, tmp_path: Path
) -> None:
    """GPTQ 8-bit: w = scale * (q - zero) with q in 0..255; a zero far from 128 puts q - zero
    outside the int8 values an 8-bit QuantizedWeight holds."""
    quantized = gptq_like_checkpoint(state, "gptq", bits=8, group_size=-1, v1=False)
    name = "model.layers.0.self_attn.o_proj.qzeros"
    quantized.tensors[name] = torch.zeros_like(quantized.tensors[name])  # zero 0: q up to 255
    with pytest.raises(ValueError, match="o_proj: 8-bit weights whose zero points"):
        read_back(source, tmp_path, quantized)


def test_quantized_experts_are_refused_in_one_line(tmp_path: Path) -> None:
    """A MoE file whose experts are quantized (the engine's expert kernels take float weights):
    one line at load, not a failure inside torch.cat."""
    from engine.builtin_build import ensure_builtin

    moe = ensure_builtin("builtin:tiny-qwen3-moe")
    quantized = compressed_tensors_checkpoint(source_state(moe), 4, True, "group", 32)
    path = write_checkpoint(moe, tmp_path, quantized.tensors, quantized.qconfig)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts: quantized experts") as refused:
        LLM(str(path), num_blocks=64)
    assert "\n" not in str(refused.value)
