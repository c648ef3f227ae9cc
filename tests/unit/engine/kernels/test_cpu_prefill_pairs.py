"""The bfloat16 dot-product path of the CPU prefill (engine/kernels/cpu_prefill_pairs.c) against
the torch reference: prompts long enough to cross several query and key blocks after a cached
prefix, GQA groups of several sizes, head sizes that split the output tiles unevenly, windows,
soft caps and sinks; that float32 queries keep the float32 tiles; threads. Where the CPU has
AMX-BF16 each test runs twice: on the tiles and on AVX512-BF16's dot products."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.kernels.reference import paged_prefill_attention_ref
from tests.paged_cache import PagedCache, assert_close

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler on this host")


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


HAS_BF16 = "avx512_bf16" in _cpu_flags()
HAS_AMX = HAS_BF16 and {"amx_tile", "amx_bf16"} <= _cpu_flags()


@pytest.fixture(
    params=["dot_products", pytest.param("amx", marks=pytest.mark.skipif(
        not HAS_AMX, reason="the host has no AMX-BF16"))]
)  # fmt: skip
def path(request: pytest.FixtureRequest):
    """The bfloat16 path's two ways of multiplying: AVX512-BF16's dot products, AMX tiles."""
    cpu_kernels.use_prefill_amx(request.param == "amx")
    try:
        yield request.param
    finally:
        cpu_kernels.use_prefill_amx(True)


def prefill_args(
    prefix_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    q_dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
) -> tuple:  # fmt: skip
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = PagedCache(lens, num_kv_heads, head_dim, block_size, torch.bfloat16, device="cpu")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = (3 * torch.randn(sum(q_lens), num_heads, head_dim)).to(q_dtype)
    return (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, head_dim**-0.5)


@pytest.mark.skipif(not HAS_BF16, reason="the host has no AVX512-BF16")
def test_the_pairs_path_is_built_where_the_cpu_has_avx512_bf16() -> None:
    """So that the tests below run the pairs path here, not only the float32 tiles."""
    assert cpu_kernels.prefill_pairs_available()


@pytest.mark.skipif(not HAS_AMX, reason="the host has no AMX-BF16")
def test_the_tiles_are_used_where_the_cpu_has_amx() -> None:
    """The kernels were built with AMX and Linux lent this process the tiles."""
    assert cpu_kernels.prefill_amx_ready()


GQA_SHAPES = [(14, 2, 64), (8, 1, 128), (6, 3, 80), (4, 4, 32)]  # (heads, KV heads, head_dim)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", GQA_SHAPES)
def test_long_prompts_after_a_cached_prefix_match_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, path: str
) -> None:
    """Chunks of several query blocks (48 rows) over several key blocks (256 keys): a fresh
    prompt, a chunk after a long prefix, one token, an empty chunk, a prompt shorter than a
    score tile; no window, a window inside a key block and one across blocks, a soft cap."""
    torch.manual_seed(11)
    args = prefill_args([0, 530, 40, 9, 0], [300, 170, 1, 0, 3], num_heads, num_kv_heads, head_dim)
    for window, cap in [(None, None), (37, None), (300, None), (None, 4.0), (90, 20.0)]:
        expected = paged_prefill_attention_ref(*args, sliding_window=window, soft_cap=cap)
        assert_close(cpu_kernels.paged_prefill_attention(*args, window, cap), expected)


@pytest.mark.parametrize("sink", ["ordinary", "very_large", "very_negative"])
def test_sinks_over_long_prompts_match_the_reference(sink: str, path: str) -> None:
    """A sink starts each row's running maximum and sum: one ordinary, one above every score
    (the output ~0), one below every score (as no sink)."""
    torch.manual_seed(12)
    num_heads = 8
    sinks = {
        "ordinary": torch.randn(num_heads),
        "very_large": torch.full((num_heads,), 1e4),
        "very_negative": torch.full((num_heads,), -1e4),
    }[sink]
    args = prefill_args([280, 0], [120, 200], num_heads, 2, 64)
    for window, cap in [(None, None), (50, None), (None, 5.0)]:
        expected = paged_prefill_attention_ref(*args, window, cap, sinks)
        assert_close(cpu_kernels.paged_prefill_attention(*args, window, cap, sinks), expected)


def test_float32_queries_over_a_bfloat16_cache_keep_float32_precision() -> None:
    """Queries that are not bfloat16 values (a float32 model over a bfloat16 cache) would be
    rounded by the pairs path: the float32 tiles take them, within float32's tolerance."""
    torch.manual_seed(13)
    args = prefill_args([100, 0], [90, 60], 8, 2, 64, q_dtype=torch.float32)
    for window, cap in [(None, None), (40, 10.0)]:
        expected = paged_prefill_attention_ref(*args, sliding_window=window, soft_cap=cap)
        assert_close(cpu_kernels.paged_prefill_attention(*args, window, cap), expected)


def test_two_threads_give_one_threads_output(path: str) -> None:
    """A task per (sequence, KV head), each row summed by one thread in one order."""
    torch.manual_seed(14)
    args = prefill_args([0, 200, 30], [260, 90, 7], 12, 4, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.paged_prefill_attention(*args, 64, None)
        torch.set_num_threads(2)
        assert torch.equal(cpu_kernels.paged_prefill_attention(*args, 64, None), one)
    finally:
        torch.set_num_threads(threads)
