"""Torch reference for paged attention: the maths the Triton kernels must match, and the CPU path.

Cache layout, per layer (a view into the block-major pool, see engine/kv_cache.py):

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)   stride(0) may exceed
                      block_size * num_kv_heads * head_dim; each block is contiguous.

A sequence's token at position p lives in block block_table[p // block_size], slot p % block_size.
The attention functions expect the KV of the tokens being computed to be in the cache already
(`store_kv_ref` writes it).
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Each sequence's first `max_len` cached tokens: (batch, max_len, num_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # (batch, num_blocks, block_size, kvh, d)
    return blocks.flatten(1, 2)[:, :max_len]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """Masked GQA attention on padded batches.

    q: (batch, num_q, num_heads, d); k, v: (batch, num_keys, num_kv_heads, d);
    allowed: (batch, num_q, num_keys) bool. Returns (batch, num_q, num_heads, d).
    """
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_q, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale  # (b, kvh, g, q, k)
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key give zeros
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(batch, num_q, num_heads, head_dim).to(q.dtype)


def key_mask(
    query_pos: torch.Tensor, context_lens: torch.Tensor, num_keys: int, sliding_window: int | None
) -> torch.Tensor:
    """(batch, num_q, num_keys) bool: causal, inside the context, inside the sliding window."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & (
        key_pos[None, None, :] < context_lens[:, None, None]
    )
    if sliding_window is not None:
        allowed &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    return allowed


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence, at position context_lens - 1.

    q: (batch, num_heads, head_dim); block_tables: (batch, max_blocks) int32;
    context_lens: (batch,) int32, counting the query token. Returns (batch, num_heads, head_dim).
    """
    max_len = int(context_lens.max())
    k = gather_kv(k_cache, block_tables, max_len)
    v = gather_kv(v_cache, block_tables, max_len)
    query_pos = (context_lens.long() - 1)[:, None]  # (batch, 1)
    allowed = key_mask(query_pos, context_lens.long(), max_len, sliding_window)
    return attend(q[:, None], k, v, allowed, scale, soft_cap)[:, 0]


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over a cached prefix plus themselves, variable lengths.

    q: (num_tokens, num_heads, head_dim), sequences packed back to back; cu_seqlens_q: (batch + 1,)
    int32 offsets into q; context_lens: (batch,) int32 total length (prefix + new tokens). New
    token j of sequence b sits at position context_lens[b] - q_len[b] + j. Returns q's shape.
    """
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    batch, max_q = q_lens.shape[0], int(q_lens.max())
    ctx = context_lens.long()
    # Scatter packed queries into a padded (batch, max_q, ...) tensor.
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=q.device), q_lens)
    idx_in_seq = torch.arange(q.shape[0], device=q.device) - cu[:-1][seq_of_token]
    padded = q.new_zeros(batch, max_q, *q.shape[1:])
    padded[seq_of_token, idx_in_seq] = q
    max_len = int(ctx.max())
    k = gather_kv(k_cache, block_tables, max_len)
    v = gather_kv(v_cache, block_tables, max_len)
    query_pos = (ctx - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]
    allowed = key_mask(query_pos, ctx, max_len, sliding_window)
    out = attend(padded, k, v, allowed, scale, soft_cap)
    return out[seq_of_token, idx_in_seq]


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v: (num_tokens, num_kv_heads, head_dim) into the cache views in place at
    slot_mapping: (num_tokens,) = block_id * block_size + offset; negative slots (padding) skip."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache[slots // block_size, slots % block_size] = k  # index_put on the view writes the pool
    v_cache[slots // block_size, slots % block_size] = v
