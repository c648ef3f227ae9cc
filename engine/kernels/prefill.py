"""Triton paged prefill / extend attention: new tokens against their cached prefix plus themselves.

One launch covers a packed batch of variable-length chunks. The grid is (query tiles, query heads).
Sequence b owns tiles [first(b), first(b + 1)) with first(b) = cu_q[b] // BLOCK_M + b: at most one
tile per sequence too many, but the grid size comes from shapes alone (no host sync) and each
program finds its sequence by a binary search over cu_seqlens_q:

    tokens:  |--- seq 0 (70) ---|-- seq 1 (20) --|------ seq 2 (100) ------|
    tiles:   [ 0 ][ 1 ]           [ 2 ]             [ 3 ][ 4 ] [ 5 ]          (BLOCK_M = 64)
             first(b) = cu_q[b] // 64 + b = 0, 2, 3; a tile past a sequence's end stores nothing.

Keys run from the window start of the tile's first query to the tile's last query position, so the
cached prefix and the causal part of the new tokens share one masked online-softmax loop. An
attention sink (gpt-oss) is the loop's starting state: m = sink, l = 1, acc = 0 (its value is zero).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.decode import LOG2E, attend_tile, load_kv_tiles, needs_upcast

BLOCK_M = 64  # query tokens per tile
BLOCK_N = 64  # keys per tile
NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, sinks_ptr,
    scale, soft_cap, sliding_window, batch,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btn,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    """One (query tile, query head): causal attention over the sequence's cached + new keys."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Largest b with first(b) <= tile; first() strictly increases, so b is unique.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + batch - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        take = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid <= tile
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M  # first new-token index of this tile
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m  # (BLOCK_M,) absolute positions of the tile's queries
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)

    kv_end = tl.where(m0 < q_len, prefix + tl.minimum(m0 + BLOCK_M, q_len), 0)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(prefix + m0 - sliding_window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink is the first "key": weight 2^(sink - m), value 0
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head) * LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_btb
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n  # (BLOCK_N,) key positions
        n_mask = pos < kv_end
        k, v = load_kv_tiles(
            k_ptr, v_ptr, table, pos, n_mask, kv_head, offs_d, d_mask, stride_btn,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
            PAGE_SIZE, HEAD_DIM, INT8,
        )  # (BLOCK_N, BLOCK_D) each  # fmt: skip
        # (BLOCK_M, BLOCK_N): causal, and inside the window (a row may see no key of this tile).
        allowed = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed &= pos[None, :] > q_pos[:, None] - sliding_window
        m_i, l_i, acc = attend_tile(
            q, k, v, allowed, m_i, l_i, acc, scale, soft_cap, HAS_SOFT_CAP, UPCAST, PRECISION
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows with no visible key give zeros
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Same contract as `paged_prefill_attention_ref`; the tile sizes (powers of two >= 16),
    warps and pipeline stages override the defaults (bench/kernels.py's prefill sweep).

    q: (num_tokens, num_heads, head_dim) packed; k_cache, v_cache: (num_blocks, block_size,
    num_kv_heads, head_dim), any strides, or int8 rows of head_dim + 4 (kv_quant.py);
    block_tables: (batch, max_blocks) int32; cu_seqlens_q: (batch + 1,) int32; context_lens:
    (batch,) prefix + new tokens; sinks: (num_heads,) float32 or None. Returns (num_tokens,
    num_heads, head_dim) in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or batch == 0:
        return out
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    num_tiles = num_tokens // block_m + batch  # = first(batch), an upper bound on the tiles used
    prefill_kernel[(num_tiles, num_heads)](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, sinks,
        scale, soft_cap or 0.0, sliding_window or 0, batch,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_tables.stride(),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=soft_cap is not None, HAS_SINKS=sinks is not None,
        UPCAST=needs_upcast(q), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INT8=k_cache.dtype == torch.int8, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
