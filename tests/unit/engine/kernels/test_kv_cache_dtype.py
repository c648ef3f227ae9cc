"""A KV cache of another dtype than the model's (kv_cache_dtype): bfloat16 under float32
queries, and int8 rows with a float32 scale each (engine/kernels/kv_quant.py), through the C
kernels, the one-call C decode step and the torch path, against the torch reference.

The reference reads an int8 cache by dequantizing it; that it does so right is held against a
float32 cache of the dequantized values, and the row format against its definition. The
Triton kernels' bfloat16 cache is tested in test_kernels.py (the interpreter's module)."""

from __future__ import annotations

import pytest
import torch

from engine import attention
from engine.kernels import cpu_kernels, kv_quant, torch_paged
from engine.kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from engine.model_config import ModelConfig, RopeConfig
from tests.paged_cache import PagedCache, assert_close, decode_metadata

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this host")

KV_DTYPES = [torch.bfloat16, torch.int8]
SHAPES = [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 80, 16)]  # heads, kv heads, head_dim, block


def kv_cache(lens: list[int], kv_heads: int, head_dim: int, block_size: int,
             dtype: torch.dtype) -> tuple[PagedCache, torch.Tensor]:  # fmt: skip
    """A random float32 PagedCache, and its pool as a cache of `dtype` stores it; the cache's
    k and v views are pointed at the converted pool."""
    cache = PagedCache(lens, kv_heads, head_dim, block_size, torch.float32, device="cpu")
    pool = kv_quant.to_cache(cache.pool, dtype)
    cache.k, cache.v = pool[:, 1, 0], pool[:, 1, 1]
    return cache, pool


def test_int8_rows_hold_values_and_their_scale_as_kv_quant_defines() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # a zero row: scale 0, values 0
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127, rtol=0, atol=0)
    assert int(rows[..., :64].abs().max()) == 127
    assert not bool(rows[0, 0].any())
    # each value within half a step of its row: the rounding, and nothing more
    error = (kv_quant.dequantize(rows) - x).abs()
    assert bool((error <= scale / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_c_store_writes_the_bytes_the_reference_writes(
    dtype: torch.dtype, source: torch.dtype
) -> None:
    """Converted or quantized in C, byte for byte as in torch; other layers, other slots and
    the padding slot untouched."""
    torch.manual_seed(3)
    cache, pool = kv_cache([40], 2, 64, 16, dtype)
    slots = torch.tensor([3, 17, 33, -1, 47])
    k, v = (3 * torch.randn(5, 2, 64)).to(source), torch.randn(5, 2, 64).to(source)
    expected = pool.clone()
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    attention.write_kv(k, v, cache.k, cache.v, slots, backend="cpu")
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_the_reference_reads_an_int8_or_bfloat16_cache_as_its_float_values(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(1)
    lens = [150, 1, 37]
    cache, pool = kv_cache(lens, 2, 64, 16, dtype)
    values = kv_quant.as_float(pool)  # a float32 pool of what the cache holds
    q = 4 * torch.randn(len(lens), 8, 64)
    tables, ctx = cache.block_tables, cache.context_lens
    out = paged_decode_attention_ref(q, cache.k, cache.v, tables, ctx, 0.125)
    expected = paged_decode_attention_ref(q, values[:, 1, 0], values[:, 1, 1], tables, ctx, 0.125)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
def test_decode_over_the_cache_matches_the_reference(
    dtype: torch.dtype, backend: str, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int,
) -> None:  # fmt: skip
    """float32 maths on the cache's values: the float32 tolerance (the C kernel takes an int8
    row's scale out of the sums, which only reorders the rounding)."""
    torch.manual_seed(2)
    lens = [150, 1, 37, 90, 16]
    cache, _ = kv_cache(lens, num_kv_heads, head_dim, block_size, dtype)
    q = 4 * torch.randn(len(lens), num_heads, head_dim)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, head_dim**-0.5)
    for window, cap in [(None, None), (20, None), (33, 5.0)]:
        expected = paged_decode_attention_ref(*args, sliding_window=window, soft_cap=cap)
        out = attention.decode_attention(*args, window, cap, backend=backend)  # type: ignore[arg-type]
        assert_close(out, expected)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
def test_prefill_over_the_cache_matches_the_reference(
    dtype: torch.dtype, backend: str, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int,
) -> None:  # fmt: skip
    torch.manual_seed(5)
    prefix_lens, q_lens = [0, 45, 19, 7], [70, 1, 22, 0]
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache, _ = kv_cache(lens, num_kv_heads, head_dim, block_size, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = 4 * torch.randn(sum(q_lens), num_heads, head_dim)
    args = (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, head_dim**-0.5)
    for window, cap in [(None, None), (16, None), (9, 5.0)]:
        expected = paged_prefill_attention_ref(*args, sliding_window=window, soft_cap=cap)
        out = attention.prefill_attention(*args, window, cap, backend=backend)  # type: ignore[arg-type]
        assert_close(out, expected)


def test_the_torch_path_plans_an_int8_cache_by_its_head_size() -> None:
    cache, _ = kv_cache([40, 3], 2, 64, 16, torch.int8)
    plan = torch_paged.plan_decode(cache.k, cache.block_tables, cache.context_lens, None)
    assert sum(len(g.seqs) for g in plan) == 2


@pytest.mark.parametrize(
    ("model_dtype", "kv_dtype"),
    [(torch.float32, torch.bfloat16), (torch.float32, torch.int8), (torch.bfloat16, torch.int8)],
)
def test_the_c_decode_step_stores_and_reads_the_cache_as_the_python_forward(
    model_dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """A decode-only batch through cpu_decode_step.c over a bfloat16 or int8 cache gives the
    Python forward's hidden states (the C kernels per layer) and writes the same cache bytes."""
    from engine.kv_cache import KVCache
    from engine.linear import pack_linear_layers
    from engine.models import llama
    from engine.models.cpu_decode import use_c_decode_step, use_cpu_kernels

    torch.manual_seed(3)
    config = ModelConfig(
        model_type="qwen2", vocab_size=300, hidden_size=72, intermediate_size=100, num_layers=3,
        num_heads=6, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope=RopeConfig(kind="default", theta=10000.0), max_position_embeddings=256,
        tie_word_embeddings=True, attention_bias=True, qk_norm=False, sliding_window=9,
        eos_token_ids=(0,), torch_dtype="float32",
    )  # fmt: skip
    model = llama.build(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model = model.to(model_dtype)
    model.attach_rotary(config.max_position_embeddings)
    pack_linear_layers(model, "panels", decode_copy=False)
    use_cpu_kernels(model)
    assert use_c_decode_step(model)
    lens = [5, 17, 30]
    block_size, blocks_per_seq = 8, 4
    caches = [KVCache(config, 16, block_size, kv_dtype, "cpu") for _ in range(2)]
    torch.manual_seed(4)
    history = kv_quant.to_cache(torch.randn(caches[0].pool.shape[:-1] + (8,)), kv_dtype)
    for cache in caches:  # the same random history in both
        cache.pool.copy_(history)
    positions, meta = decode_metadata(lens, block_size, blocks_per_seq)
    ids = torch.tensor([7, 250, 31])
    in_c = model(ids, positions, caches[0].layers, meta)
    model.c_decode_max_rows = 0
    in_python = model(ids, positions, caches[1].layers, meta)
    torch.testing.assert_close(in_c, in_python, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0].pool, caches[1].pool)
