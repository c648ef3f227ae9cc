"""Triton paged-attention kernels against the torch reference; the reference against a naive loop.

Without a GPU the kernels run in the Triton interpreter. @triton.jit picks compiled vs interpreted
when it decorates, and triton's own helpers (tl.sum, tl.cdiv, ...) are decorated when triton is
first imported, so TRITON_INTERPRET=1 must be set before anything in the process imports triton.
torch does not import it and the engine imports it lazily, so setting it here, at collection,
normally works and keeps per-test reports in one pytest process. If a module collected earlier has
already imported triton compiled, the kernel tests here skip and
`test_kernels_in_a_fresh_interpreter_process` reruns this file in a subprocess with the variable
set. With a GPU nothing is set and the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine import attention  # noqa: E402
from engine.kernels import (  # noqa: E402
    cpu_kernels,
    decode,
    kv_quant,
    prefill,
    store_kv,
    torch_paged,
)
from engine.kernels.reference import (  # noqa: E402
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kv_ref,
)
from tests.paged_cache import DEVICE, PagedCache, assert_close  # noqa: E402

RUN_HERE = ON_GPU or all(
    isinstance(fn, InterpretedFunction)
    for fn in (
        tl.cdiv,
        decode.decode_split_kernel,
        prefill.prefill_kernel,
        store_kv.store_kv_kernel,
    )
)
needs_kernels = pytest.mark.skipif(
    not RUN_HERE, reason="triton was imported compiled before this module: run in a subprocess"
)

# --- the reference against a naive per-token loop -----------------------------------------------


def _naive_attention(
    q: torch.Tensor,  # (num_heads, head_dim), one query token
    cache: PagedCache,
    seq: int,
    pos: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    q, k, v = q.cpu(), cache.k.cpu(), cache.v.cpu()  # the loop runs on the CPU, in float64
    num_heads, head_dim = q.shape
    num_kv_heads, block_size = k.shape[2], k.shape[1]
    out = torch.zeros(num_heads, head_dim, dtype=torch.float64)
    for h in range(num_heads):
        kv_head = h // (num_heads // num_kv_heads)
        scores, values = [], []
        for p in range(pos + 1):
            if sliding_window is not None and p <= pos - sliding_window:
                continue
            block = int(cache.block_tables[seq, p // block_size])
            key = k[block, p % block_size, kv_head].double()
            s = float(q[h].double() @ key) * scale
            scores.append(soft_cap * math.tanh(s / soft_cap) if soft_cap else s)
            values.append(v[block, p % block_size, kv_head].double())
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        for w, value in zip(weights, values, strict=True):
            out[h] += w / sum(weights) * value
    return out


@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (3, 2.0)])
def test_reference_matches_naive_loop(sliding_window: int | None, soft_cap: float | None) -> None:
    torch.manual_seed(0)
    cache = PagedCache([7, 3], num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    scale = 0.5
    q = torch.randn(2, 4, 8, device=DEVICE)  # (batch, num_heads, head_dim)
    out = paged_decode_attention_ref(
        q, cache.k, cache.v, cache.block_tables, cache.context_lens, scale, sliding_window, soft_cap
    )
    for b, n in enumerate([7, 3]):
        expected = _naive_attention(q[b].cpu(), cache, b, n - 1, scale, sliding_window, soft_cap)
        torch.testing.assert_close(out[b].double().cpu(), expected, atol=1e-5, rtol=1e-5)

    q_lens = [4, 1]  # sequence 0: prefix 3 + 4 new tokens; sequence 1: prefix 2 + 1
    cu = torch.tensor([0, 4, 5], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(5, 4, 8, device=DEVICE)
    out = paged_prefill_attention_ref(
        qp, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, scale, sliding_window,
        soft_cap,
    )  # fmt: skip
    for b, (n, q_len) in enumerate(zip([7, 3], q_lens, strict=True)):
        for j in range(q_len):
            token = int(cu[b]) + j
            pos = n - q_len + j
            expected = _naive_attention(
                qp[token].cpu(), cache, b, pos, scale, sliding_window, soft_cap
            )
            torch.testing.assert_close(out[token].double().cpu(), expected, atol=1e-5, rtol=1e-5)


# --- decode ---------------------------------------------------------------------------------------

DECODE_SHAPES = [  # (dtype, num_heads, num_kv_heads, head_dim, block_size)
    (torch.float32, 4, 4, 64, 16),
    (torch.float32, 8, 2, 128, 32),
    (torch.float32, 16, 2, 64, 16),
    (torch.float16, 8, 2, 64, 16),
    (torch.float16, 4, 4, 128, 32),
    (torch.bfloat16, 16, 2, 128, 32),
    (torch.bfloat16, 8, 2, 64, 16),
]


@needs_kernels
@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, head_dim, block_size", DECODE_SHAPES)
def test_decode_matches_reference_on_mixed_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    torch.manual_seed(1)
    lens = [1, 37, 150]  # short and long, not multiples of the block size
    cache = PagedCache(lens, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(lens), num_heads, head_dim, dtype=dtype, device=DEVICE)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, head_dim**-0.5)
    assert_close(decode.paged_decode_attention(*args), paged_decode_attention_ref(*args))


@needs_kernels
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_kv_merges_to_reference(num_splits: int) -> None:
    """3 splits of 64-token tiles all hold keys; 8 leaves most splits of every sequence empty."""
    torch.manual_seed(2)
    cache = PagedCache([9, 190], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    q = torch.randn(2, 8, 64, dtype=torch.float16, device=DEVICE)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    out = decode.paged_decode_attention(*args, num_splits=num_splits)
    assert_close(out, paged_decode_attention_ref(*args))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sliding_window_and_soft_cap(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    cache = PagedCache([5, 70, 140], num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    q = 4 * torch.randn(3, 8, 64, dtype=dtype, device=DEVICE)  # large scores make the cap matter
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    for window, cap in [(20, None), (None, 3.0), (33, 5.0)]:
        expected = paged_decode_attention_ref(*args, sliding_window=window, soft_cap=cap)
        out = decode.paged_decode_attention(*args, window, cap, num_splits=2)
        assert_close(out, expected)


def test_decode_split_heuristic() -> None:
    h200_sms = 132
    assert decode.choose_num_splits(1, 8, 16384, h200_sms) == decode.MAX_SPLITS
    assert decode.choose_num_splits(1, 8, 1024, h200_sms) == 1024 // decode.MIN_TOKENS_PER_SPLIT
    assert decode.choose_num_splits(16, 8, 4096, h200_sms) > 1
    assert decode.choose_num_splits(64, 8, 4096, h200_sms) == 1
    assert decode.choose_num_splits(4, 8, 100, h200_sms) == 1  # too short to be worth a merge


def test_small_batches_get_short_tiles_and_more_splits() -> None:
    """Batch 1-8 at short contexts (fewer programs than SMs): 32-key tiles and splits down to 64
    tokens; a batch that fills the SMs keeps 64-key tiles and the 256-token splits."""
    h100_sms = 132
    small = decode.choose_decode_config(1, 8, 1024, h100_sms)
    assert small.block_n == decode.SMALL_BATCH_BLOCK_N
    assert small.num_splits == 1024 // decode.SMALL_BATCH_MIN_TOKENS_PER_SPLIT  # 16, was 4
    assert decode.choose_decode_config(8, 8, 512, h100_sms).num_splits == 8  # by length
    assert decode.choose_decode_config(4, 2, 16384, h100_sms).num_splits == decode.MAX_SPLITS
    big = decode.choose_decode_config(64, 8, 4096, h100_sms)
    assert big == decode.DecodeConfig(1, decode.BLOCK_N)
    # 16 x 8 = 128 programs leave SMs idle; 17 x 8 = 136 fill them
    assert decode.choose_decode_config(16, 8, 4096, h100_sms).block_n == decode.SMALL_BATCH_BLOCK_N
    assert decode.choose_decode_config(17, 8, 4096, h100_sms).block_n == decode.BLOCK_N


@needs_kernels
@pytest.mark.parametrize("block_n, num_splits", [(16, 1), (16, 5), (32, 3), (32, 16)])
def test_decode_short_tiles_merge_to_reference(block_n: int, num_splits: int) -> None:
    """The small-batch tunings (16- and 32-key tiles, splits of one tile or less) give the
    reference's output; 16 splits of 32 keys leave the short sequence's later splits empty."""
    torch.manual_seed(4)
    cache = PagedCache(
        [3, 77, 200], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    q = torch.randn(3, 14, 64, dtype=torch.bfloat16, device=DEVICE)  # group 7, as Qwen2.5-0.5B
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    out = decode.paged_decode_attention(*args, num_splits=num_splits, block_n=block_n, num_warps=2)
    assert_close(out, paged_decode_attention_ref(*args))


# --- prefill --------------------------------------------------------------------------------------

PREFILL_SHAPES = [  # (dtype, num_heads, num_kv_heads, head_dim, block_size)
    (torch.float32, 4, 4, 64, 16),
    (torch.float32, 8, 1, 32, 16),
    (torch.float32, 8, 2, 128, 32),
    (torch.float16, 8, 2, 64, 32),
    (torch.bfloat16, 8, 1, 128, 16),
]


def _packed_queries(
    q_lens: list[int], num_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (num_tokens, num_heads, head_dim) packed, and cu_seqlens_q: (batch + 1,)."""
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=DEVICE)
    return q, cu.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, head_dim, block_size", PREFILL_SHAPES)
def test_prefill_with_cached_prefix_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    torch.manual_seed(4)
    prefix_lens, q_lens = (
        [0, 45, 19],
        [70, 1, 22],
    )  # fresh prompt crossing a tile; decode-like; extend
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = PagedCache(lens, num_kv_heads, head_dim, block_size, dtype)
    q, cu = _packed_queries(q_lens, num_heads, head_dim, dtype)
    args = (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, head_dim**-0.5)
    assert_close(prefill.paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


@needs_kernels
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (128, 64)])
def test_prefill_tile_sizes_of_the_sweep_match_reference(block_m: int, block_n: int) -> None:
    """bench/kernels.py's prefill sweep: other tile sizes give the reference's output, tiles
    smaller and larger than the chunks (a sequence spans several tiles, or a tile several)."""
    torch.manual_seed(6)
    prefix_lens, q_lens = [0, 45, 19], [70, 1, 22]
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = PagedCache(lens, 2, 64, 16, torch.bfloat16)
    q, cu = _packed_queries(q_lens, 8, 64, torch.bfloat16)
    args = (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, 0.125)
    out = prefill.paged_prefill_attention(*args, block_m=block_m, block_n=block_n, num_warps=8)
    assert_close(out, paged_prefill_attention_ref(*args))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_sliding_window_and_soft_cap(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    prefix_lens, q_lens = [30, 0, 7], [40, 3, 0]  # an empty chunk in the batch is legal
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = PagedCache(lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    q, cu = _packed_queries(q_lens, 4, 64, dtype)
    q = 4 * q
    args = (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, 0.125)
    for window, cap in [(16, None), (None, 3.0), (9, 5.0)]:
        expected = paged_prefill_attention_ref(*args, sliding_window=window, soft_cap=cap)
        assert_close(prefill.paged_prefill_attention(*args, window, cap), expected)


# --- attention sinks (gpt-oss) --------------------------------------------------------------------

WINDOWS_AND_CAPS = [(None, None), (20, None), (None, 3.0), (9, 5.0)]  # gpt-oss: window 128, no cap


def _sinks(num_heads: int) -> torch.Tensor:
    """(num_heads,) float32 sink logits of the size of real scores, one head's sink dominant."""
    sinks = 2 * torch.randn(num_heads, device=DEVICE)
    sinks[0] = 12.0  # most of head 0's weight goes to the sink
    return sinks


def _assert_sinks_matter(with_sinks: torch.Tensor, without: torch.Tensor) -> None:
    """The reference with sinks is not the reference without (a kernel ignoring them fails)."""
    assert (with_sinks.float() - without.float()).abs().max() > 0.1


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_sinks_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, num_splits: int
) -> None:
    """The sink joins the softmax once: with one split in stage 1, with several in the merge
    (3 splits of [1, 37, 150] leave the short sequences' later splits empty)."""
    torch.manual_seed(12)
    cache = PagedCache([1, 37, 150], num_kv_heads, head_dim=32, block_size=16, dtype=dtype)
    q = 4 * torch.randn(3, num_heads, 32, dtype=dtype, device=DEVICE)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 32**-0.5)
    sinks = _sinks(num_heads)
    for window, cap in WINDOWS_AND_CAPS:
        expected = paged_decode_attention_ref(*args, window, cap, sinks)
        _assert_sinks_matter(expected, paged_decode_attention_ref(*args, window, cap))
        out = decode.paged_decode_attention(*args, window, cap, sinks, num_splits=num_splits)
        assert_close(out, expected)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)])
def test_prefill_with_sinks_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int
) -> None:
    torch.manual_seed(13)
    prefix_lens, q_lens = [0, 45, 19, 7], [70, 1, 22, 0]  # fresh, decode-like, extend, empty
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = PagedCache(lens, num_kv_heads, head_dim=32, block_size=16, dtype=dtype)
    q, cu = _packed_queries(q_lens, num_heads, 32, dtype)
    args = (4 * q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, 32**-0.5)
    sinks = _sinks(num_heads)
    for window, cap in WINDOWS_AND_CAPS:
        expected = paged_prefill_attention_ref(*args, window, cap, sinks)
        _assert_sinks_matter(expected, paged_prefill_attention_ref(*args, window, cap))
        assert_close(prefill.paged_prefill_attention(*args, window, cap, sinks), expected)


@needs_kernels
def test_every_backend_takes_sinks_and_only_triton_runs_the_triton_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sinks with a window through each backend equal the reference; the Triton kernels run for
    the forced "triton" backend only (no fallback hides a kernel that ignores them)."""
    torch.manual_seed(14)
    cache = PagedCache([30, 5], 2, 32, 16, torch.float32)
    q = torch.randn(2, 4, 32, device=DEVICE)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    sinks = _sinks(4)
    tables, lens = cache.block_tables, cache.context_lens
    decode_args = (q, cache.k, cache.v, tables, lens, 0.25, 12)
    prefill_args = (q, cache.k, cache.v, tables, cu, lens, 0.25, 12)
    expected_decode = paged_decode_attention_ref(*decode_args, sinks=sinks)
    expected_prefill = paged_prefill_attention_ref(*prefill_args, sinks=sinks)
    calls: list[str] = []
    for module, name in [(decode, "paged_decode_attention"), (prefill, "paged_prefill_attention")]:
        kernel = getattr(module, name)

        def counted(*args: object, _kernel: Callable[..., torch.Tensor] = kernel,
                    _name: str = name, **kwargs: object) -> torch.Tensor:  # fmt: skip
            calls.append(_name)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    backends: tuple[attention.AttentionBackend, ...] = ("triton", "torch", "cpu")
    for backend in backends:
        if backend == "cpu" and not cpu_kernels.supports(cache.k):
            continue
        dec = attention.decode_attention(*decode_args, sinks=sinks, backend=backend)
        pre = attention.prefill_attention(*prefill_args, sinks=sinks, backend=backend)
        assert_close(dec, expected_decode)
        assert_close(pre, expected_prefill)
    assert calls == ["paged_decode_attention", "paged_prefill_attention"]  # triton's only


# --- the torch path (the CPU's) against the reference ---------------------------------------------


@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, head_dim, block_size", DECODE_SHAPES)
def test_torch_path_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    torch.manual_seed(8)
    lens = [150, 1, 37, 90]  # unsorted: the path sorts by length and must put rows back
    cache = PagedCache(lens, num_kv_heads, head_dim, block_size, dtype)
    q = 4 * torch.randn(len(lens), num_heads, head_dim, dtype=dtype, device=DEVICE)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, head_dim**-0.5)
    for window, cap in [(None, None), (20, None), (None, 3.0), (33, 5.0)]:
        expected = paged_decode_attention_ref(*args, sliding_window=window, soft_cap=cap)
        assert_close(torch_paged.paged_decode_attention(*args, window, cap), expected)


def test_torch_path_decode_groups_cover_every_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small group budget: many groups, a sequence longer than the budget alone in its group."""
    assert torch_paged._runs([3, 5, 5, 9, 40], max_tokens=12) == [
        slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)
    ]  # fmt: skip
    torch.manual_seed(9)
    lens = [int(n) for n in torch.randint(1, 200, (24,))]
    cache = PagedCache(lens, 2, 64, 16, torch.float32)
    q = torch.randn(len(lens), 8, 64, device=DEVICE)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    monkeypatch.setattr(torch_paged, "GROUP_BYTES", 100 * 2 * 2 * 64 * 4)  # 100 tokens' K and V
    assert_close(torch_paged.paged_decode_attention(*args), paged_decode_attention_ref(*args))


def test_torch_path_plan_is_made_once_per_pass_and_per_window() -> None:
    """The layers of one forward pass share a dict: the first layer's plan serves the others
    (their caches differ, their tables and lengths do not); another window gets its own."""
    torch.manual_seed(11)
    layers = [PagedCache([30, 5, 61], 2, 64, 16, torch.float32) for _ in range(2)]
    tables, lens = layers[0].block_tables, layers[0].context_lens
    q = torch.randn(3, 8, 64, device=DEVICE)
    shared: dict[str, object] = {}
    for window in (None, None, 12):
        for layer in layers:
            args = (q, layer.k, layer.v, tables, lens, 0.125, window)
            out = attention.decode_attention(*args, backend="torch", shared=shared)
            assert_close(out, paged_decode_attention_ref(*args))
    assert sorted(shared) == ["torch_decode_plan/12", "torch_decode_plan/None"]


@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, head_dim, block_size", PREFILL_SHAPES)
def test_torch_path_prefill_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    torch.manual_seed(10)
    prefix_lens, q_lens = [0, 45, 19, 7], [70, 1, 22, 0]  # fresh, decode-like, extend, empty
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    cache = PagedCache(lens, num_kv_heads, head_dim, block_size, dtype)
    q, cu = _packed_queries(q_lens, num_heads, head_dim, dtype)
    args = (4 * q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, head_dim**-0.5)
    for window, cap in [(None, None), (16, None), (9, 5.0)]:
        expected = paged_prefill_attention_ref(*args, sliding_window=window, soft_cap=cap)
        assert_close(torch_paged.paged_prefill_attention(*args, window, cap), expected)


# --- store_kv and the dispatch --------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_slots_of_the_pool_view(dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    cache = PagedCache([40], num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    slots = torch.tensor([3, 17, 33, -1, 47], device=DEVICE)  # -1: padding token, not written
    k = torch.randn(5, 2, 64, dtype=dtype, device=DEVICE)
    v = torch.randn(5, 2, 64, dtype=dtype, device=DEVICE)
    expected = cache.pool.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 16, 1, 0, slot % 16] = k[t]
            expected[slot // 16, 1, 1, slot % 16] = v[t]
    reference_pool = cache.pool.clone()
    store_kv_ref(k, v, reference_pool[:, 1, 0], reference_pool[:, 1, 1], slots)
    store_kv.store_kv(k, v, cache.k, cache.v, slots)
    assert torch.equal(reference_pool, expected)
    assert torch.equal(cache.pool, expected)  # other layers and the padding slot untouched


@needs_kernels
def test_a_bfloat16_kv_cache_under_float32_queries_matches_the_reference() -> None:
    """kv_cache_dtype bfloat16 with a float32 model: the store rounds k and v to bfloat16 as the
    reference does, and decode and prefill widen the cache to float32 (float32 maths, so the
    float32 tolerance)."""
    torch.manual_seed(8)
    cache = PagedCache([40, 90], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, -1, 33], device=DEVICE)
    k, v = (torch.randn(4, 2, 64, device=DEVICE) for _ in range(2))  # float32
    expected = cache.pool.clone()
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    store_kv.store_kv(k, v, cache.k, cache.v, slots)
    assert torch.equal(cache.pool, expected)
    q = 4 * torch.randn(2, 8, 64, device=DEVICE)
    args = (q, cache.k, cache.v, cache.block_tables, cache.context_lens, 0.125)
    assert_close(decode.paged_decode_attention(*args), paged_decode_attention_ref(*args))
    q, cu = _packed_queries([25, 7], 8, 64, torch.float32)
    args = (q, cache.k, cache.v, cache.block_tables, cu, cache.context_lens, 0.125)
    assert_close(prefill.paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


@needs_kernels
def test_an_int8_kv_cache_is_written_and_read_as_the_reference_does() -> None:
    """kv_cache_dtype int8 (kv_quant.py's rows): the store quantizes to the reference's bytes
    (its arithmetic: max / 127, IEEE division, ties to even), decode and prefill dequantize
    (float32 maths, so the float32 tolerance); a split decode too."""
    torch.manual_seed(9)
    cache = PagedCache([40, 90], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    pool = kv_quant.quantize(cache.pool)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    slots = torch.tensor([3, 17, -1, 33], device=DEVICE)
    k, v = 3 * torch.randn(4, 2, 64, device=DEVICE), torch.randn(4, 2, 64, device=DEVICE)
    k[1, 0] = 0.0  # a zero row: scale 0
    k[3, 1, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0])  # ties, once the scale is 1
    expected = pool.clone()
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    store_kv.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(pool, expected)
    q = 4 * torch.randn(2, 8, 64, device=DEVICE)
    args = (q, k_cache, v_cache, cache.block_tables, cache.context_lens, 0.125)
    for num_splits in (1, 3):
        out = decode.paged_decode_attention(*args, num_splits=num_splits)
        assert_close(out, paged_decode_attention_ref(*args))
    q, cu = _packed_queries([25, 7], 8, 64, torch.float32)
    args = (q, k_cache, v_cache, cache.block_tables, cu, cache.context_lens, 0.125)
    assert_close(prefill.paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


@needs_kernels
def test_dispatch_forced_triton_matches_torch_end_to_end() -> None:
    """write_kv + prefill + decode through both backends give the same cache and outputs."""
    torch.manual_seed(7)
    dtype, num_heads, head_dim = torch.float16, 8, 64
    backends: tuple[attention.AttentionBackend, ...] = ("torch", "triton")
    caches = {b: PagedCache([20, 50], 2, head_dim, 16, dtype) for b in backends}
    caches["triton"].pool.copy_(caches["torch"].pool)
    caches["triton"].block_tables = caches["torch"].block_tables
    c = caches["torch"]
    k = torch.randn(3, 2, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(3, 2, head_dim, dtype=dtype, device=DEVICE)
    bt = c.block_tables

    def slot(seq: int, pos: int) -> int:
        return int(bt[seq, pos // 16]) * 16 + pos % 16

    # The new tokens: the decode token of sequence 0 and a 2-token chunk ending sequence 1.
    slots = torch.tensor([slot(0, 19), slot(1, 48), slot(1, 49)], device=DEVICE)
    q = torch.randn(3, num_heads, head_dim, dtype=dtype, device=DEVICE)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    outs = {}
    for backend, cache in caches.items():
        attention.write_kv(k, v, cache.k, cache.v, slots, backend=backend)
        dec = attention.decode_attention(
            q[:1], cache.k, cache.v, bt[:1], c.context_lens[:1], 0.125, backend=backend
        )
        pre = attention.prefill_attention(
            q[1:], cache.k, cache.v, bt[1:], cu[1:] - 1, c.context_lens[1:], 0.125, backend=backend
        )
        outs[backend] = (dec, pre)
    assert torch.equal(caches["torch"].pool, caches["triton"].pool)
    for got, expected in zip(outs["triton"], outs["torch"], strict=True):
        assert_close(got, expected)


def test_dispatch_auto_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("auto took the Triton path")

    monkeypatch.setattr(decode, "paged_decode_attention", fail)
    x = torch.zeros(1, 4, 16, device=DEVICE)
    assert attention._use_triton("auto", x) is ON_GPU
    if not ON_GPU:
        cache = PagedCache([3], 4, 16, 16, torch.float32)
        attention.decode_attention(x, cache.k, cache.v, cache.block_tables, cache.context_lens, 1.0)
    with pytest.raises(ValueError, match="attention backend"):
        attention._use_triton("cuda", x)  # type: ignore[arg-type]


def test_dispatch_refuses_compiled_kernels_on_cpu() -> None:
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        attention._check_runnable(torch.zeros(1), object())


@pytest.mark.skipif(RUN_HERE, reason="the kernels run in this process")
def test_kernels_in_a_fresh_interpreter_process() -> None:
    """Triton was imported compiled before this module: rerun the file in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    argv += ["-k", "not test_kernels_in_a_fresh_interpreter_process"]
    root = Path(__file__).resolve().parents[4]
    result = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "skipped" not in result.stdout.splitlines()[-1]  # the kernels really ran there
